//! The examples run against a real daemon, and the README shows the quick start verbatim.

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
fn readme_shows_the_quickstart_verbatim() {
    let example = include_str!("../examples/quickstart.rs");
    let readme = include_str!("../../../README.md");
    let start = example.find("// README example begins").unwrap();
    let end = example.find("// README example ends").unwrap();
    let body: Vec<&str> = example[start..end].lines().skip(1).collect();
    let body = body.join("\n");
    assert!(
        readme.contains(body.trim()),
        "README.md must contain the quick start from crates/client/examples/quickstart.rs verbatim"
    );
}
