//! Loading hostile and odd directories: symlinks out of the roots are refused by name
//! (a tenant must not read the operator's files into a child, through an include or
//! not), while the links Kubernetes and git-sync make keep working; binary and
//! non-rule files and dangling links are skipped with at most a warning.

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

use rulebook::cli::{CheckArgs, Command, RuleDirs, run_offline};
use rulebook::render::Limits;
use rulebook::rules::{self, Diagnostic};

/// A rule whose one child renders `config.yaml`.
const RULE: &str = "apiVersion: rulebook.dev/v1alpha1
kind: Rule
metadata:
  name: demo
spec:
  parent:
    apiVersion: test.rulebook.dev/v1
    kind: Demo
  children:
    - name: config
      apiVersion: v1
      kind: ConfigMap
      template: config.yaml
";

const CONFIG: &str = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: x\n";

/// `rules/demo.yaml` and `templates/config.yaml` below `root`; returns both directories.
fn rule_set(root: &Path, config: &str) -> (PathBuf, PathBuf) {
    let (rules, templates) = (root.join("rules"), root.join("templates"));
    std::fs::create_dir_all(&rules).unwrap();
    std::fs::create_dir_all(&templates).unwrap();
    std::fs::write(rules.join("demo.yaml"), RULE).unwrap();
    std::fs::write(templates.join("config.yaml"), config).unwrap();
    (rules, templates)
}

fn shown(ds: &[Diagnostic]) -> String {
    ds.iter().map(|d| format!("  {d}\n")).collect()
}

/// The errors of a rule set that must not load.
fn errors(rules: &Path, templates: &Path) -> Vec<Diagnostic> {
    match rulebook::render::load(rules, templates, &Limits::default()) {
        Ok(set) => panic!("loaded: {set:?}"),
        Err(d) => d.0,
    }
}

/// `rulebook check`: exit code, stdout, stderr.
fn check(rules: &Path, templates: &Path) -> (i32, String, String) {
    let command = Command::Check(CheckArgs {
        dirs: RuleDirs {
            rules: rules.to_path_buf(),
            templates: templates.to_path_buf(),
            default_rollout: None,
        },
        kubeconfig: None,
        schema: Default::default(),
    });
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let code = run_offline(&command, &mut out, &mut err).unwrap();
    (
        code,
        String::from_utf8(out).unwrap(),
        String::from_utf8(err).unwrap(),
    )
}

#[test]
fn an_included_link_to_etc_hostname_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let (rules, templates) = rule_set(
        dir.path(),
        &format!("{CONFIG}data:\n  host: {{% include \"host.txt\" %}}\n"),
    );
    symlink("/etc/hostname", templates.join("host.txt")).unwrap();
    let errors = errors(&rules, &templates);
    let link = templates.join("host.txt").display().to_string();
    assert!(
        errors.iter().any(|d| d.file == link
            && d.message.contains("links to /etc/hostname")
            && d.message
                .contains("outside the rules and templates directories")),
        "no refusal of {link}:\n{}",
        shown(&errors)
    );
    // Refused even when nothing uses it: nothing outside the roots is read.
    std::fs::write(templates.join("config.yaml"), CONFIG).unwrap();
    let (code, _, stderr) = check(&rules, &templates);
    assert_eq!(code, 1, "{stderr}");
    assert!(
        stderr.contains(&format!("{link}: links to /etc/hostname")),
        "{stderr}"
    );
}

#[test]
fn links_out_of_the_roots_are_refused_for_files_directories_and_rules() {
    let dir = tempfile::tempdir().unwrap();
    let (rules, templates) = rule_set(&dir.path().join("tenant"), CONFIG);
    let secrets = dir.path().join("secrets");
    std::fs::create_dir_all(&secrets).unwrap();
    std::fs::write(secrets.join("token"), "TOKEN-VALUE").unwrap();
    std::fs::write(secrets.join("rule.yaml"), RULE.replace("demo", "other")).unwrap();
    // A file, a directory (through `..`, relative), and a rule file.
    symlink(secrets.join("token"), templates.join("token")).unwrap();
    symlink("../../secrets", templates.join("sa")).unwrap();
    symlink(secrets.join("rule.yaml"), rules.join("other.yaml")).unwrap();
    // Not a rule file: never read, so nothing to refuse.
    symlink(secrets.join("token"), rules.join("notes.txt")).unwrap();
    let errors = errors(&rules, &templates);
    let real = std::fs::canonicalize(&secrets).unwrap();
    let refused = |file: PathBuf, target: PathBuf| {
        let file = file.display().to_string();
        let needle = format!("links to {}, which is outside", target.display());
        assert!(
            errors
                .iter()
                .any(|d| d.file == file && d.message.contains(&needle)),
            "no refusal of {file} → {}:\n{}",
            target.display(),
            shown(&errors)
        );
    };
    refused(templates.join("token"), real.join("token"));
    refused(templates.join("sa"), real.clone());
    refused(rules.join("other.yaml"), real.join("rule.yaml"));
    assert_eq!(errors.len(), 3, "{}", shown(&errors));
    assert!(!format!("{errors:?}").contains("TOKEN-VALUE"));
}

#[test]
fn links_inside_the_roots_are_followed() {
    let dir = tempfile::tempdir().unwrap();
    let (rules, templates) = rule_set(dir.path(), CONFIG);
    std::fs::create_dir_all(templates.join("lib")).unwrap();
    std::fs::write(templates.join("lib/real.yaml"), "x: 1\n").unwrap();
    symlink("../config.yaml", templates.join("lib/alias.yaml")).unwrap();
    symlink("lib", templates.join("shared")).unwrap();
    // A template may also be a link into the rules directory.
    symlink("../rules/demo.yaml", templates.join("rule-copy.yaml")).unwrap();
    let read = rules::read(&rules, &templates);
    assert!(read.errors.is_empty(), "{}", shown(&read.errors));
    let names: Vec<&str> = read.sources.templates.keys().map(String::as_str).collect();
    assert_eq!(
        names,
        [
            "config.yaml",
            "lib/alias.yaml",
            "lib/real.yaml",
            "rule-copy.yaml",
            "shared/alias.yaml",
            "shared/real.yaml"
        ]
    );
    assert_eq!(read.sources.templates["lib/alias.yaml"].1, CONFIG);
}

/// The kubelet's layout: the files in `..<stamp>/`, `..data -> ..<stamp>`, and each
/// top-level entry `name -> ..data/name`; an update writes a new stamp and flips `..data`.
fn configmap_volume(mount: &Path, stamp: &str, files: &[(&str, &str)]) {
    let data = mount.join(stamp);
    let mut top = std::collections::BTreeSet::new();
    for (path, text) in files {
        let file = data.join(path);
        std::fs::create_dir_all(file.parent().unwrap()).unwrap();
        std::fs::write(file, text).unwrap();
        top.insert(path.split('/').next().unwrap().to_string());
    }
    let tmp = mount.join("..data_tmp");
    symlink(stamp, &tmp).unwrap();
    std::fs::rename(&tmp, mount.join("..data")).unwrap();
    for entry in top {
        let visible = mount.join(&entry);
        if std::fs::symlink_metadata(&visible).is_err() {
            symlink(format!("..data/{entry}"), visible).unwrap();
        }
    }
}

#[test]
fn a_configmap_volume_layout_is_accepted() {
    let dir = tempfile::tempdir().unwrap();
    let (rules, templates) = (dir.path().join("rules"), dir.path().join("templates"));
    std::fs::create_dir_all(&rules).unwrap();
    std::fs::create_dir_all(&templates).unwrap();
    let rule = RULE.replace("template: config.yaml", "template: demo/config.yaml");
    configmap_volume(&rules, "..2026_11_23_10_00_00.1", &[("demo.yaml", &rule)]);
    configmap_volume(
        &templates,
        "..2026_11_23_10_00_00.1",
        &[("demo/config.yaml", CONFIG)],
    );
    let first = rulebook::render::load(&rules, &templates, &Limits::default())
        .unwrap_or_else(|d| panic!("{d}"));
    assert_eq!(first.rules.len(), 1);
    let read = rules::read(&rules, &templates);
    assert!(read.warnings.is_empty(), "{}", shown(&read.warnings));
    // Display paths are the visible ones, never the stamped directory.
    assert_eq!(
        read.sources.rule_files[0].0,
        rules.join("demo.yaml").display().to_string()
    );
    assert!(read.sources.templates.contains_key("demo/config.yaml"));

    // An update: a new stamp, `..data` flipped, the old stamp removed.
    let changed = format!("{CONFIG}data:\n  v: \"2\"\n");
    configmap_volume(
        &templates,
        "..2026_11_23_10_05_00.2",
        &[("demo/config.yaml", &changed)],
    );
    std::fs::remove_dir_all(templates.join("..2026_11_23_10_00_00.1")).unwrap();
    let second = rulebook::render::load(&rules, &templates, &Limits::default())
        .unwrap_or_else(|d| panic!("{d}"));
    assert_ne!(first.fingerprint, second.fingerprint);
}

#[test]
fn a_git_sync_style_symlinked_root_is_accepted() {
    let dir = tempfile::tempdir().unwrap();
    let git = dir.path().join("git");
    rule_set(&git.join("rev-abc"), CONFIG);
    symlink("rev-abc", git.join("current")).unwrap();
    let (rules, templates) = (git.join("current/rules"), git.join("current/templates"));
    let read = rules::read(&rules, &templates);
    assert!(read.errors.is_empty(), "{}", shown(&read.errors));
    assert!(read.warnings.is_empty(), "{}", shown(&read.warnings));
    // Shown through the link, as given.
    assert_eq!(
        read.sources.rule_files[0].0,
        rules.join("demo.yaml").display().to_string()
    );
    let a =
        rulebook::render::compile_read(&read, &Limits::default()).unwrap_or_else(|d| panic!("{d}"));

    // The flip to a new revision, and a root that is itself a link.
    rule_set(&git.join("rev-def"), &format!("{CONFIG}data: {{}}\n"));
    let tmp = git.join("current.tmp");
    symlink("rev-def", &tmp).unwrap();
    std::fs::rename(&tmp, git.join("current")).unwrap();
    symlink(git.join("current/templates"), dir.path().join("templates")).unwrap();
    let b = rulebook::render::load(&rules, &dir.path().join("templates"), &Limits::default())
        .unwrap_or_else(|d| panic!("{d}"));
    assert_ne!(a.fingerprint, b.fingerprint);
}

#[test]
fn binary_and_non_rule_files_do_not_invalidate_the_rule_set() {
    let dir = tempfile::tempdir().unwrap();
    let (rules, templates) = rule_set(dir.path(), CONFIG);
    let binary = [0x89, b'P', b'N', b'G', 0xff, 0xfe, 0x00, 0x01];
    std::fs::write(rules.join("logo.png"), binary).unwrap();
    std::fs::write(rules.join("README.md"), "# Not a rule\n: : :\n").unwrap();
    std::fs::write(rules.join("demo.yaml.orig"), "not: [a rule").unwrap();
    std::fs::write(templates.join("logo.png"), binary).unwrap();
    let read = rules::read(&rules, &templates);
    assert!(read.errors.is_empty(), "{}", shown(&read.errors));
    assert_eq!(read.sources.rule_files.len(), 1);
    // Only the binary template is worth a warning: templates are any file.
    let png = templates.join("logo.png").display().to_string();
    assert_eq!(read.warnings.len(), 1, "{}", shown(&read.warnings));
    assert_eq!(read.warnings[0].file, png);
    assert!(read.warnings[0].message.contains("not UTF-8"));
    assert_eq!(
        rulebook::render::compile_read(&read, &Limits::default())
            .map(|s| s.rules.len())
            .ok(),
        Some(1)
    );

    let (code, stdout, stderr) = check(&rules, &templates);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.ends_with("1 rules valid\n"), "{stdout}");
    assert_eq!(
        stderr,
        format!("warning: {png}: not UTF-8 text: skipped (a template is text)\n")
    );
}

#[test]
fn a_binary_rule_file_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let (rules, templates) = rule_set(dir.path(), CONFIG);
    std::fs::write(rules.join("bad.yaml"), [0xff, 0xfe, b'\n']).unwrap();
    let errors = errors(&rules, &templates);
    assert_eq!(errors.len(), 1, "{}", shown(&errors));
    assert_eq!(errors[0].file, rules.join("bad.yaml").display().to_string());
    assert!(errors[0].message.contains("not UTF-8"));
}

#[test]
fn a_dangling_link_is_a_warning_and_the_set_stays_valid() {
    let dir = tempfile::tempdir().unwrap();
    let (rules, templates) = rule_set(dir.path(), CONFIG);
    symlink("gone.yaml", rules.join("old.yaml")).unwrap();
    symlink("/nonexistent/partial.yaml", templates.join("partial.yaml")).unwrap();
    // A directory linking to itself is skipped too.
    symlink(".", templates.join("loop")).unwrap();
    let read = rules::read(&rules, &templates);
    assert!(read.errors.is_empty(), "{}", shown(&read.errors));
    let warned = |file: PathBuf, needle: &str| {
        let file = file.display().to_string();
        assert!(
            read.warnings
                .iter()
                .any(|w| w.file == file && w.message.contains(needle)),
            "no warning {file}: ...{needle}...:\n{}",
            shown(&read.warnings)
        );
    };
    warned(
        rules.join("old.yaml"),
        "dangling symlink to gone.yaml: skipped",
    );
    warned(
        templates.join("partial.yaml"),
        "dangling symlink to /nonexistent/partial.yaml",
    );
    warned(templates.join("loop"), "links to a directory above it");
    assert_eq!(read.warnings.len(), 3, "{}", shown(&read.warnings));
    let set =
        rulebook::render::compile_read(&read, &Limits::default()).unwrap_or_else(|d| panic!("{d}"));
    assert_eq!(set.rules.len(), 1);
    // The warnings are part of what was seen: a new dangling link is a change.
    let again = rules::read(&rules, &templates);
    assert_eq!(again.fingerprint(), set.fingerprint);
    std::fs::remove_file(templates.join("loop")).unwrap();
    assert_ne!(
        rules::read(&rules, &templates).fingerprint(),
        set.fingerprint
    );

    let (code, _, stderr) = check(&rules, &templates);
    assert_eq!(code, 0, "{stderr}");
    assert!(
        stderr.contains(&format!(
            "warning: {}: dangling symlink to gone.yaml: skipped",
            rules.join("old.yaml").display()
        )),
        "{stderr}"
    );
}

/// A rule with its own CRD for kind `kind`, named `name`; `extra` is added to its spec.
fn crd_rule(name: &str, kind: &str, extra: &str) -> String {
    format!(
        "apiVersion: rulebook.dev/v1alpha1\nkind: Rule\nmetadata:\n  name: {name}\nspec:\n  parent:\n    apiVersion: test.rulebook.dev/v1\n    kind: {kind}\n  crd:\n    specSchema:\n      type: object\n  children:\n    - name: config\n      apiVersion: v1\n      kind: ConfigMap\n      template: config.yaml\n{extra}"
    )
}

#[test]
fn a_default_rollout_is_checked_at_its_own_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let (rules, templates) = rule_set(dir.path(), CONFIG);
    std::fs::write(rules.join("web.yaml"), crd_rule("web", "Web", "")).unwrap();
    let default = dir.path().join("rollout.yaml");
    std::fs::write(
        &default,
        "steps:\n  - parents: 1\n  - percent: 50\ngate: \"batch.ready >=\"\nonFailure: Retry\n",
    )
    .unwrap();
    let command = Command::Check(CheckArgs {
        dirs: RuleDirs {
            rules: rules.clone(),
            templates: templates.clone(),
            default_rollout: Some(default.clone()),
        },
        kubeconfig: None,
        schema: Default::default(),
    });
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let code = run_offline(&command, &mut out, &mut err).unwrap();
    let stderr = String::from_utf8(err).unwrap();
    assert_eq!(code, 1, "{stderr}");
    let file = default.display();
    for (line, what) in [
        (
            3,
            "default rollout: rollout.steps[1]: the last step is `percent: 100`",
        ),
        (
            5,
            "default rollout: rollout.onFailure: 'Retry' is neither Rollback nor Pause",
        ),
    ] {
        assert!(
            stderr.contains(&format!("{file}:{line}")) && stderr.contains(what),
            "no {file}:{line} {what}:\n{stderr}"
        );
    }
    // The expressions are checked once the structure is sound, at their line too.
    std::fs::write(
        &default,
        "steps:\n  - parents: 1\n  - percent: 100\ngate: \"batch.ready >=\"\n",
    )
    .unwrap();
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let code = run_offline(&command, &mut out, &mut err).unwrap();
    let stderr = String::from_utf8(err).unwrap();
    assert_eq!(code, 1, "{stderr}");
    assert!(
        stderr.contains(&format!("{file}:4"))
            && stderr.contains("rollout.gate: invalid expression"),
        "{stderr}"
    );
    // A file that is not there is an error, not a rule set without a default.
    std::fs::remove_file(&default).unwrap();
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let code = run_offline(&command, &mut out, &mut err).unwrap();
    let stderr = String::from_utf8(err).unwrap();
    assert_eq!(code, 1, "{stderr}");
    assert!(
        stderr.contains("cannot read the default rollout"),
        "{stderr}"
    );
}

#[test]
fn a_default_rollout_is_the_rollout_of_each_rule_with_a_crd_and_none_of_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let (rules, templates) = rule_set(dir.path(), CONFIG);
    std::fs::write(rules.join("web.yaml"), crd_rule("web", "Web", "")).unwrap();
    let own = "  rollout:\n    steps:\n      - percent: 100\n";
    std::fs::write(rules.join("own.yaml"), crd_rule("own", "Own", own)).unwrap();
    let default = dir.path().join("rollout.yaml");
    std::fs::write(
        &default,
        "steps:\n  - parents: 1\n  - percent: 100\n    pause: 1m\ngate: \"batch.ready >= batch.total and batch.age >= '30s'\"\nonFailure: Pause\n",
    )
    .unwrap();
    let without =
        rulebook::render::compile_read(&rules::read(&rules, &templates), &Limits::default())
            .unwrap_or_else(|d| panic!("{d}"));
    let read = rules::read(&rules, &templates).with_default_rollout(Some(&default));
    let with =
        rulebook::render::compile_read(&read, &Limits::default()).unwrap_or_else(|d| panic!("{d}"));
    let steps = |set: &rulebook::render::RuleSet, rule: &str| {
        set.rules[rule]
            .rule
            .spec
            .rollout
            .as_ref()
            .map(|r| r.steps.len())
    };
    // `web` gets the default; `own` keeps its own; `demo` has no CRD, so no rollout.
    assert_eq!(steps(&without, "web"), None);
    assert_eq!(steps(&with, "web"), Some(2));
    assert_eq!(steps(&with, "own"), Some(1));
    assert_eq!(steps(&with, "demo"), None);
    assert!(
        with.rules["web"].rollout.is_some(),
        "the default's expressions are compiled"
    );
    // Part of the rule as written: of its version, and of the set's fingerprint (a changed
    // default file is a reload); a rule that keeps its own rollout keeps its version.
    assert_ne!(with.rules["web"].version, without.rules["web"].version);
    assert_eq!(with.rules["own"].version, without.rules["own"].version);
    assert_ne!(with.fingerprint, without.fingerprint);
}
