//! What the user sees besides results: progress bars on standard error for runs longer than a
//! moment, errors printed once, and a quiet end when standard output is closed.
//!
//! Bars draw only on a terminal (indicatif hides them otherwise), so scripts and tests reading
//! stderr see only errors.

use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

/// Ends the process quietly when standard output is closed (`agora run --list | head -1`).
///
/// Rust ignores SIGPIPE, so `println!` on a closed pipe panics ("failed printing to stdout:
/// Broken pipe"). Restoring SIGPIPE's default would also kill a client whose daemon went away,
/// so instead this hook recognises exactly that panic and exits with the status a process
/// killed by SIGPIPE has (141), printing nothing; every other panic is reported as before.
pub fn quiet_on_closed_stdout() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let message = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or("");
        if message.starts_with("failed printing to std") && message.contains("Broken pipe") {
            std::process::exit(141);
        }
        default(info);
    }));
}

/// An error and its causes, each said once: a cause whose text its parent already contains (a
/// client error that repeats its source) is not printed again.
pub fn render_error(error: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in error.chain() {
        let text = cause.to_string();
        if out.contains(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}

/// A bar of `total` steps that appears only if the work is still going after a second.
pub fn bar(total: u64, message: &str) -> ProgressBar {
    let bar = ProgressBar::hidden();
    bar.set_length(total);
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} tasks · {elapsed} (eta {eta})")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_message(message.to_string());
    bar
}

/// A spinner with elapsed time, for a phase of unknown length.
pub fn spinner(message: &str) -> ProgressBar {
    let bar = ProgressBar::hidden();
    bar.set_style(
        ProgressStyle::with_template("{spinner} {msg} · {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    bar.set_message(message.to_string());
    bar
}

/// Shows `bar` on standard error (if it is a terminal) and keeps it ticking.
pub fn show(bar: &ProgressBar) {
    bar.set_draw_target(indicatif::ProgressDrawTarget::stderr());
    bar.enable_steady_tick(Duration::from_millis(200));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_repeated_cause_is_printed_once() {
        let inner = anyhow::anyhow!("allocation of 8 bytes failed: quota left 4");
        let outer = inner.context("allocation of 8 bytes failed: quota left 4");
        assert_eq!(render_error(&outer), "allocation of 8 bytes failed: quota left 4");
        let chained = anyhow::anyhow!("no such file").context("cannot read the configuration file x");
        assert_eq!(
            render_error(&chained),
            "cannot read the configuration file x: no such file"
        );
    }
}
