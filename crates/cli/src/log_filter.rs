//! `AGORA_LOG`, checked before it becomes the log filter.
//!
//! `tracing_subscriber::EnvFilter` takes any word it does not know as the name of a target:
//! `AGORA_LOG=wran` means "log only the target called `wran`", and an empty value is an empty
//! filter. Both parse, and both hide every line the daemon writes, errors included, so a typo in
//! a unit file's `Environment=AGORA_LOG=` turned the journal silent. A value is used only when
//! each of its directives is one an operator could mean; otherwise the default level applies
//! and one warning says why.

use tracing_subscriber::EnvFilter;

/// The variable that sets the log filter.
pub const LOG_ENV: &str = "AGORA_LOG";

/// The level names `EnvFilter` knows; a directive that is one of them sets the global level.
const LEVELS: [&str; 6] = ["trace", "debug", "info", "warn", "error", "off"];

/// What `AGORA_LOG` holds.
#[derive(Debug, PartialEq, Eq)]
pub enum LogSetting {
    /// Not set: the default level.
    Unset,
    /// A value whose every directive is a level, `TARGET=LEVEL` or a module path.
    Use(String),
    /// A value that would hide lines it was not meant to; `directive` is the first offending
    /// one (empty for an empty value).
    Refused { value: String, directive: String },
}

/// Sorts a value of `AGORA_LOG` (`None` when unset).
pub fn classify(value: Option<&str>) -> LogSetting {
    let Some(value) = value else {
        return LogSetting::Unset;
    };
    let refused = |directive: &str| LogSetting::Refused {
        value: value.to_owned(),
        directive: directive.to_owned(),
    };
    // Empty pieces (`info,`) are harmless, but a value with nothing else in it filters out
    // everything.
    let directives: Vec<&str> = value.split(',').map(str::trim).filter(|d| !d.is_empty()).collect();
    if directives.is_empty() {
        return refused("");
    }
    if let Some(bad) = directives.iter().find(|d| !is_meant(d)) {
        return refused(bad);
    }
    // The checks above are looser than EnvFilter's grammar (spans, fields): what it still
    // cannot parse is refused the same way.
    if EnvFilter::try_new(value).is_err() {
        return refused(value);
    }
    LogSetting::Use(value.to_owned())
}

/// A directive an operator could mean: a level, `TARGET=LEVEL`, or a target that is one of our
/// modules (`agora_daemon`, `agora_daemon::server`, or any path with `::`). A bare word that is
/// none of these is a misspelt level far more often than a target name.
fn is_meant(directive: &str) -> bool {
    let is_level = |word: &str| LEVELS.iter().any(|level| level.eq_ignore_ascii_case(word.trim()));
    if is_level(directive) {
        return true;
    }
    if let Some((target, level)) = directive.rsplit_once('=') {
        return !target.trim().is_empty() && is_level(level);
    }
    directive.contains("::") || directive.starts_with("agora")
}

/// The filter for this process: `AGORA_LOG` when it is usable, else `default` (a level). The
/// second value is the warning to log once the subscriber is up, when the variable was refused.
pub fn from_env(default: &str) -> (EnvFilter, Option<String>) {
    let value = std::env::var(LOG_ENV).ok();
    match classify(value.as_deref()) {
        LogSetting::Use(value) => (EnvFilter::new(value), None),
        LogSetting::Unset => (EnvFilter::new(default), None),
        LogSetting::Refused { value, directive } => {
            let which = if directive.is_empty() || directive == value {
                String::new()
            } else {
                format!(" ('{directive}' is not)")
            };
            let warning = format!(
                "{LOG_ENV}='{value}' is not used{which}: give a level ({}), TARGET=LEVEL \
                 (agora_daemon=debug), or a module path (agora_daemon::server), separated by \
                 commas; logging at the default level, {default}",
                LEVELS.join(", ")
            );
            (EnvFilter::new(default), Some(warning))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn used(value: &str) -> bool {
        matches!(classify(Some(value)), LogSetting::Use(_))
    }

    #[test]
    fn levels_targets_and_module_paths_are_used() {
        for value in [
            "info",
            "WARN",
            "off",
            "debug,",
            "warn,agora_daemon=debug",
            "agora_daemon::server=trace",
            "agora_daemon",
            "agora_daemon::server",
            "tokio::net",
            "info,hyper=warn",
            "agora_daemon[serve]=debug",
        ] {
            assert!(used(value), "{value}");
        }
    }

    #[test]
    fn misspelt_words_and_empty_values_are_refused() {
        for (value, directive) in [
            ("wran", "wran"),
            ("verbose", "verbose"),
            ("", ""),
            (" , ", ""),
            ("info,wran", "wran"),
            ("agora_daemon=loud", "agora_daemon=loud"),
            ("=debug", "=debug"),
        ] {
            assert_eq!(
                classify(Some(value)),
                LogSetting::Refused {
                    value: value.to_owned(),
                    directive: directive.to_owned()
                },
                "{value}"
            );
        }
        assert_eq!(classify(None), LogSetting::Unset);
    }
}
