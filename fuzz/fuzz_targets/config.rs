//! The daemon's TOML configuration file (`agora serve --config FILE`, `DaemonConfig::from_toml`).
//!
//! Properties: a text either parses into settings that validate, or is refused with a typed
//! error (`Parse` or `Invalid`) that says something (never a panic); every number accepted is
//! finite; what parsed prints (`--print-config`) as a file that parses back to the same
//! settings, printed identically.
#![no_main]

use agora_daemon::{ConfigError, DaemonConfig};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match DaemonConfig::from_toml(text) {
        Ok(config) => {
            if let Err(e) = config.validate() {
                panic!("a configuration that parsed does not validate: {e}");
            }
            let printed = config.to_toml();
            // Every number it accepted is finite (NaN would pass any `<` check).
            for line in printed.lines() {
                let value = line.split_once(" = ").map_or("", |(_, v)| v.trim());
                assert!(
                    !matches!(value, "nan" | "+nan" | "-nan" | "inf" | "+inf" | "-inf"),
                    "accepted a number that is not finite: {line}"
                );
            }
            let back = DaemonConfig::from_toml(&printed)
                .unwrap_or_else(|e| panic!("the printed configuration does not parse: {e}\n{printed}"));
            assert_eq!(back.to_toml(), printed, "printing is not a round trip");
        }
        Err(ConfigError::Parse(m) | ConfigError::Invalid(m)) => assert!(!m.trim().is_empty()),
    }
});
