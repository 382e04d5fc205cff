//! Byte sizes with suffixes on the command line (`512M`, `2G`, `4096`): the daemon's parser, so
//! flags and configuration files accept the same spellings.

pub use agora_daemon::parse_bytes;
