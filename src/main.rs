use clap::Parser;
use rulebook::cli::{Cli, run_offline};

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match run_offline(&cli.command, &mut std::io::stdout(), &mut std::io::stderr()) {
        Ok(code) => std::process::exit(code),
        // `rulebook render ... | head` is not an error.
        Err(e)
            if e.downcast_ref::<std::io::Error>()
                .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe) =>
        {
            std::process::exit(0)
        }
        Err(e) => Err(e),
    }
}
