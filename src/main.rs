//! The `rulebook` binary: parses the command line, sets up logging and the async
//! runtime for `run` (and for `diff` and `release`, which talk to a cluster), and maps
//! errors to exit codes. Everything else is in the library.

use clap::Parser;
use rulebook::cli::{Cli, Command, run_offline};

/// jemalloc rather than glibc's malloc. A reconcile builds and drops JSON trees (serde_json
/// maps are B-trees of small nodes), and under glibc a quarter of the operator's CPU went
/// to malloc, free and their consolidation; at 10,000 parents jemalloc took the
/// converge's CPU from 29.2 to 21.9 s and RSS from 105 to 100 MiB (docs/benchmarks.md).
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's options (read before `main`; `_RJEM_MALLOC_CONF` in the environment overrides
/// them). Freed memory goes back to the system within about 100 ms, purged by jemalloc's
/// background threads: by default each of its arenas (8 on 2 cores) keeps freed pages for
/// 10 s, and purges them only when that arena allocates again. A tenant whose 40 parents
/// each read ~15 MB of referenced objects made the operator free hundreds of MB a second:
/// in a 512 MiB cgroup it was OOM-killed with the default although its reconciles held
/// ~100 MB at once; with a 1 s decay it peaked at 228-398 MiB, with 100 ms at 186-215 MiB,
/// with 0 at 136-158 MiB, for the same CPU within the noise
/// (`heavy_reference_flood_under_a_memory_limit`, docs/faults.md).
#[allow(non_upper_case_globals)]
#[unsafe(export_name = "_rjem_malloc_conf")]
static malloc_conf: &[u8; 59] = b"background_thread:true,dirty_decay_ms:100,muzzy_decay_ms:0\0";

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if let Command::Run(args) = cli.command {
        init_logging(&args.log_format);
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?;
        return runtime.block_on(rulebook::operator::run(args.settings()));
    }
    if matches!(
        cli.command,
        Command::Diff(_) | Command::Release(_) | Command::Rollout(_)
    ) || matches!(&cli.command, Command::Check(a) if a.kubeconfig.is_some())
    {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?;
        let code = runtime.block_on(rulebook::cli::run_online(
            &cli.command,
            &mut std::io::stdout(),
            &mut std::io::stderr(),
        ))?;
        std::process::exit(code);
    }
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

/// `RUST_LOG`-style filtering (default `info`; client libraries never log response
/// bodies: [`rulebook::operator::log_filter`]), text or JSON lines on stderr.
fn init_logging(format: &str) {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::{Layer, fmt};
    let rust_log = std::env::var("RUST_LOG").ok();
    let filter = rulebook::operator::log_filter(rust_log.as_deref());
    let registry = tracing_subscriber::registry();
    if format == "json" {
        let layer = fmt::layer()
            .json()
            .with_current_span(true)
            .with_writer(std::io::stderr);
        registry.with(layer.with_filter(filter)).init();
    } else {
        let layer = fmt::layer().with_writer(std::io::stderr);
        registry.with(layer.with_filter(filter)).init();
    }
}
