//! The examples run against a real daemon, and the README and the Rust guide show the quick start
//! verbatim.

#[path = "../examples/quickstart.rs"]
#[allow(dead_code)]
mod quickstart;

mod common;

#[test]
fn quickstart_runs_against_a_daemon() {
    let (daemon, session) = common::daemon("quickstart");
    quickstart::quickstart(&session).unwrap();
    drop(session);
    daemon.stop().unwrap();
}

#[test]
fn readme_and_rust_guide_show_the_quickstart_verbatim() {
    let example = include_str!("../examples/quickstart.rs");
    let start = example.find("// README example begins").unwrap();
    let end = example.find("// README example ends").unwrap();
    let body: Vec<&str> = example[start..end].lines().skip(1).collect();
    let body = body.join("\n");
    for (path, text) in [
        ("README.md", include_str!("../../../README.md")),
        (
            "docs/getting-started-rust.md",
            include_str!("../../../docs/getting-started-rust.md"),
        ),
    ] {
        assert!(
            text.contains(body.trim()),
            "{path} must contain the quick start from crates/client/examples/quickstart.rs verbatim"
        );
    }
}
