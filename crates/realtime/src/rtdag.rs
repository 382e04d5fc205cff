//! Reading RTDAG task-set files (the YAML input of the AMPERE project's DAG emulator).
//!
//! Owns the mapping from RTDAG's flat, per-task-array format to [`DagSpec`]: one YAML document
//! per DAG (RTDAG runs one DAG per file; several documents separated by `---` give several
//! DAGs). Fields used:
//!
//! | RTDAG field | becomes |
//! |---|---|
//! | `dag_name` (required) | [`DagSpec::name`] |
//! | `dag_period` µs (required) | [`DagSpec::period_us`] |
//! | `dag_deadline` µs | [`DagSpec::deadline_us`] (the period if absent) |
//! | `tasks_name` (required) | node names; its length is the number of tasks |
//! | `n_tasks` | checked against the arrays' lengths |
//! | `tasks_wcet` µs (required) | [`NodeSpec::wcet_us`] |
//! | `tasks_rel_deadline` µs | [`NodeSpec::relative_deadline_us`] (kept as declared) |
//! | `tasks_type` (`cpu`, `fred`, `omp`, ...) | [`NodeSpec::device_kind`] |
//! | `tasks_expected_wcet_ratio` | checked to lie in (0, 1] (one value for all or one per task), not used: it scales RTDAG's emulated work, not the WCET |
//! | `adjacency_matrix` (required) | an edge `row → column` for every non-zero entry (bytes sent) |
//!
//! Everything else RTDAG reads (`tasks_runtime`, `tasks_affinity`, `cpus_freq`, `repetitions`,
//! `hyperperiod`, matrix sizes, priorities, ...) configures the emulator, not the task model,
//! and is ignored, as are keys this parser does not know — except one spelt almost like a
//! field read here (`dag_dealine`), which is refused naming the field: ignoring it would drop
//! what it sets without a word. `tasks_wcet`, not `tasks_runtime`,
//! is the WCET: the runtime is RTDAG's `SCHED_DEADLINE` budget, which admission recomputes.
//!
//! Errors name the source, the line of the offending key and the field; structural problems
//! that the YAML is fine with (a cycle, a deadline shorter than the critical path) are left to
//! [`DagSpec::validate`]. It must not validate timing or touch the file system beyond
//! [`read_file`].

use std::path::Path;

use serde::Deserialize;
use thiserror::Error;

use crate::model::{DagSpec, NodeSpec};

/// Why an RTDAG file could not be turned into DAG specs.
#[derive(Debug, Error)]
pub enum RtdagError {
    /// The file could not be read.
    #[error("cannot read RTDAG file {path}: {source}")]
    Io {
        /// The path given.
        path: String,
        /// What the OS said.
        source: std::io::Error,
    },
    /// Not YAML, or a value of the wrong type (e.g. text where a number belongs).
    #[error("{source_name}{}: {message}", location(*line, *column))]
    Yaml {
        /// File name or other label of the text.
        source_name: String,
        /// 1-based line, when the parser knows it.
        line: Option<usize>,
        /// 1-based column, when the parser knows it.
        column: Option<usize>,
        /// The parser's message (it names the field path, e.g. `tasks_wcet[2]`).
        message: String,
    },
    /// The text holds no DAG at all.
    #[error("{source_name}: no DAG found; an RTDAG file needs at least dag_name, dag_period, tasks_name, tasks_wcet and adjacency_matrix")]
    Empty {
        /// File name or other label.
        source_name: String,
    },
    /// A required field is absent.
    #[error("{source_name}:{line}: DAG {document} has no '{field}'; RTDAG files need dag_name, dag_period, tasks_name, tasks_wcet and adjacency_matrix")]
    MissingField {
        /// File name or other label.
        source_name: String,
        /// First line of the DAG's document.
        line: usize,
        /// 1-based number of the document in the file.
        document: usize,
        /// The missing field.
        field: &'static str,
    },
    /// A per-task array whose length does not match the number of tasks.
    #[error("{source_name}:{line}: '{field}' has {found} entries but {reference} says there are {expected} tasks; give exactly one entry per task")]
    WrongLength {
        /// File name or other label.
        source_name: String,
        /// Line of the field.
        line: usize,
        /// The field.
        field: &'static str,
        /// Entries found.
        found: usize,
        /// Entries expected.
        expected: usize,
        /// Where the expected count comes from (`tasks_name` or `n_tasks`).
        reference: &'static str,
    },
    /// A key that is none of the fields read but is spelt almost like one: ignoring it would
    /// silently drop what it sets (a misspelt `dag_deadline` left the deadline at the period).
    #[error("{source_name}:{line}: unknown key '{key}': did you mean '{field}'? (other keys are ignored as RTDAG emulator settings, but this one is too close to a field to be one)")]
    Misspelt {
        /// File name or other label.
        source_name: String,
        /// Line of the key.
        line: usize,
        /// The key as written.
        key: String,
        /// The field it resembles.
        field: &'static str,
    },
    /// A value out of its range.
    #[error("{source_name}:{line}: {field}{} is {value}; {expected}", index.map(|index| format!("[{index}]")).unwrap_or_default())]
    BadValue {
        /// File name or other label.
        source_name: String,
        /// Line of the field.
        line: usize,
        /// The field.
        field: &'static str,
        /// Position within the field's array, if it is one.
        index: Option<usize>,
        /// The offending value, as written.
        value: String,
        /// What would be accepted.
        expected: &'static str,
    },
}

fn location(line: Option<usize>, column: Option<usize>) -> String {
    match (line, column) {
        (Some(line), Some(column)) => format!(":{line}:{column}"),
        (Some(line), None) => format!(":{line}"),
        _ => String::new(),
    }
}

/// The fields of one RTDAG document this crate reads; all optional here so that a missing one
/// gets our own error with a line number rather than the parser's.
#[derive(Debug, Deserialize)]
struct RawDag {
    dag_name: Option<String>,
    n_tasks: Option<i64>,
    dag_period: Option<i64>,
    dag_deadline: Option<i64>,
    tasks_name: Option<Vec<String>>,
    tasks_type: Option<Vec<String>>,
    tasks_wcet: Option<Vec<i64>>,
    tasks_rel_deadline: Option<Vec<i64>>,
    tasks_expected_wcet_ratio: Option<Vec<f64>>,
    adjacency_matrix: Option<Vec<Vec<i64>>>,
    /// Every other key: ignored (RTDAG's emulator settings), unless it looks like a misspelling
    /// of one of the fields above ([`Document::misspelt`]).
    #[serde(flatten)]
    others: std::collections::BTreeMap<String, serde::de::IgnoredAny>,
}

/// The fields this parser reads, for [`Document::misspelt`].
const FIELDS: [&str; 10] = [
    "dag_name",
    "n_tasks",
    "dag_period",
    "dag_deadline",
    "tasks_name",
    "tasks_type",
    "tasks_wcet",
    "tasks_rel_deadline",
    "tasks_expected_wcet_ratio",
    "adjacency_matrix",
];

/// Keys of RTDAG's own format that this parser does not read (they configure its emulator):
/// never taken for misspellings, however close to a field they are.
const RTDAG_KEYS: [&str; 14] = [
    "n_edges",
    "max_msg_len",
    "tasks_matrix_size",
    "tasks_omp_target",
    "tasks_ticks_per_us",
    "n_cpus",
    "max_out_edges",
    "max_in_edges",
    "max_path_len",
    "hyperperiod",
    "repetitions",
    "tasks_runtime",
    "tasks_affinity",
    "cpus_freq",
];

/// Reads an RTDAG file; see [`parse_str`].
pub fn read_file(path: &Path) -> Result<Vec<DagSpec>, RtdagError> {
    let text = std::fs::read_to_string(path).map_err(|source| RtdagError::Io {
        path: path.display().to_string(),
        source,
    })?;
    parse_str(&text, &path.display().to_string())
}

/// Parses RTDAG YAML text, one DAG per document. `source_name` labels errors (a file name).
pub fn parse_str(text: &str, source_name: &str) -> Result<Vec<DagSpec>, RtdagError> {
    let documents = document_line_ranges(text);
    if documents.is_empty() {
        return Err(RtdagError::Empty {
            source_name: source_name.to_owned(),
        });
    }
    let lines: Vec<&str> = text.lines().collect();
    let mut dags = Vec::with_capacity(documents.len());
    for (number, document) in serde_norway::Deserializer::from_str(text).enumerate() {
        let raw = RawDag::deserialize(document).map_err(|error| {
            let location = error.location();
            RtdagError::Yaml {
                source_name: source_name.to_owned(),
                line: location.as_ref().map(|location| location.line()),
                column: location.as_ref().map(|location| location.column()),
                message: strip_location(&error.to_string()),
            }
        })?;
        // Documents are counted alike by the parser and by `document_line_ranges` for any file
        // that parsed; fall back to the whole text if they ever disagree.
        let range = documents.get(number).cloned().unwrap_or(0..lines.len());
        let context = Document {
            source_name,
            lines: &lines,
            range,
            number: number + 1,
        };
        dags.push(context.convert(raw)?);
    }
    Ok(dags)
}

/// serde's message ends with " at line L column C"; the error carries that position already.
fn strip_location(message: &str) -> String {
    match message.rfind(" at line ") {
        Some(position) => message[..position].to_owned(),
        None => message.to_owned(),
    }
}

/// 0-based line ranges of the non-empty YAML documents in `text` (split at `---` lines).
fn document_line_ranges(text: &str) -> Vec<std::ops::Range<usize>> {
    let lines: Vec<&str> = text.lines().collect();
    let mut ranges = Vec::new();
    let mut start = 0;
    let is_content = |line: &&str| {
        let trimmed = line.trim();
        !trimmed.is_empty() && !trimmed.starts_with('#') && trimmed != "..."
    };
    for (index, line) in lines.iter().enumerate() {
        if line.starts_with("---") {
            if lines[start..index].iter().any(is_content) {
                ranges.push(start..index);
            }
            start = index + 1;
        }
    }
    if lines[start..].iter().any(is_content) {
        ranges.push(start..lines.len());
    }
    ranges
}

/// One document being converted, with what is needed to word its errors.
struct Document<'a> {
    source_name: &'a str,
    lines: &'a [&'a str],
    range: std::ops::Range<usize>,
    number: usize,
}

impl Document<'_> {
    /// 1-based line of top-level `key:` in this document, or its first line.
    fn line_of(&self, key: &str) -> usize {
        let found = self.lines[self.range.clone()].iter().position(|line| {
            let unquoted = line.trim_start_matches(['"', '\'']);
            unquoted.strip_prefix(key).is_some_and(|rest| {
                let rest = rest.trim_start_matches(['"', '\'']).trim_start();
                rest.starts_with(':')
            })
        });
        self.range.start + found.unwrap_or(0) + 1
    }

    fn missing(&self, field: &'static str) -> RtdagError {
        RtdagError::MissingField {
            source_name: self.source_name.to_owned(),
            line: self.range.start + 1,
            document: self.number,
            field,
        }
    }

    fn bad(
        &self,
        field: &'static str,
        index: Option<usize>,
        value: impl ToString,
        expected: &'static str,
    ) -> RtdagError {
        RtdagError::BadValue {
            source_name: self.source_name.to_owned(),
            line: self.line_of(field),
            field,
            index,
            value: value.to_string(),
            expected,
        }
    }

    fn check_length(
        &self,
        field: &'static str,
        found: usize,
        expected: usize,
        reference: &'static str,
    ) -> Result<(), RtdagError> {
        if found == expected {
            return Ok(());
        }
        Err(RtdagError::WrongLength {
            source_name: self.source_name.to_owned(),
            line: self.line_of(field),
            field,
            found,
            expected,
            reference,
        })
    }

    fn positive(&self, field: &'static str, index: Option<usize>, value: i64) -> Result<u64, RtdagError> {
        u64::try_from(value)
            .ok()
            .filter(|&value| value > 0)
            .ok_or_else(|| self.bad(field, index, value, "it must be a positive number of microseconds"))
    }

    /// An error for the first key of `others` that is spelt almost like a field: at most two
    /// edits apart, or equal once case, `-` and `_` are ignored.
    fn misspelt(&self, others: &std::collections::BTreeMap<String, serde::de::IgnoredAny>) -> Result<(), RtdagError> {
        let folded = |key: &str| key.to_ascii_lowercase().replace(['-', '_'], "");
        for key in others.keys() {
            if RTDAG_KEYS.contains(&key.as_str()) {
                continue;
            }
            let close = FIELDS
                .iter()
                .find(|field| folded(key) == folded(field) || strsim::levenshtein(key, field) <= 2);
            if let Some(field) = close {
                return Err(RtdagError::Misspelt {
                    source_name: self.source_name.to_owned(),
                    line: self.line_of(key),
                    key: key.clone(),
                    field,
                });
            }
        }
        Ok(())
    }

    fn convert(&self, raw: RawDag) -> Result<DagSpec, RtdagError> {
        self.misspelt(&raw.others)?;
        let name = raw.dag_name.ok_or_else(|| self.missing("dag_name"))?;
        let period = raw.dag_period.ok_or_else(|| self.missing("dag_period"))?;
        let period_us = self.positive("dag_period", None, period)?;
        let deadline_us = raw
            .dag_deadline
            .map(|deadline| self.positive("dag_deadline", None, deadline))
            .transpose()?;

        let names = raw.tasks_name.ok_or_else(|| self.missing("tasks_name"))?;
        let task_count = names.len();
        if let Some(declared) = raw.n_tasks {
            let declared = usize::try_from(declared)
                .map_err(|_| self.bad("n_tasks", None, declared, "it must be the number of tasks"))?;
            self.check_length("tasks_name", task_count, declared, "n_tasks")?;
        }

        let wcets = raw.tasks_wcet.ok_or_else(|| self.missing("tasks_wcet"))?;
        self.check_length("tasks_wcet", wcets.len(), task_count, "tasks_name")?;
        let wcets = wcets
            .iter()
            .enumerate()
            .map(|(index, &wcet)| self.positive("tasks_wcet", Some(index), wcet))
            .collect::<Result<Vec<_>, _>>()?;

        let relative_deadlines = match raw.tasks_rel_deadline {
            Some(values) => {
                self.check_length("tasks_rel_deadline", values.len(), task_count, "tasks_name")?;
                values
                    .iter()
                    .enumerate()
                    .map(|(index, &deadline)| self.positive("tasks_rel_deadline", Some(index), deadline).map(Some))
                    .collect::<Result<Vec<_>, _>>()?
            }
            None => vec![None; task_count],
        };

        let kinds = match raw.tasks_type {
            Some(kinds) => {
                self.check_length("tasks_type", kinds.len(), task_count, "tasks_name")?;
                kinds.into_iter().map(Some).collect()
            }
            None => vec![None; task_count],
        };

        if let Some(ratios) = raw.tasks_expected_wcet_ratio {
            // RTDAG accepts a single value for every task.
            if ratios.len() != 1 {
                self.check_length("tasks_expected_wcet_ratio", ratios.len(), task_count, "tasks_name")?;
            }
            if let Some((index, ratio)) = ratios
                .iter()
                .enumerate()
                .find(|(_, &ratio)| !(ratio > 0.0 && ratio <= 1.0))
            {
                return Err(self.bad("tasks_expected_wcet_ratio", Some(index), ratio, "it must be in (0, 1]"));
            }
        }

        let matrix = raw.adjacency_matrix.ok_or_else(|| self.missing("adjacency_matrix"))?;
        self.check_length("adjacency_matrix", matrix.len(), task_count, "tasks_name")?;
        let mut edges = Vec::new();
        for (row, columns) in matrix.iter().enumerate() {
            if columns.len() != task_count {
                return Err(self.bad(
                    "adjacency_matrix",
                    Some(row),
                    format!("a row of {} entries", columns.len()),
                    "each row needs one entry per task",
                ));
            }
            for (column, &bytes) in columns.iter().enumerate() {
                if bytes < 0 {
                    return Err(self.bad(
                        "adjacency_matrix",
                        Some(row),
                        bytes,
                        "entries are bytes sent per edge: 0 for no edge, positive for an edge",
                    ));
                }
                if bytes > 0 {
                    edges.push((row, column));
                }
            }
        }

        let nodes = names
            .into_iter()
            .zip(wcets)
            .zip(relative_deadlines)
            .zip(kinds)
            .map(|(((name, wcet_us), relative_deadline_us), device_kind)| NodeSpec {
                name,
                wcet_us,
                relative_deadline_us,
                device_kind,
            })
            .collect();
        Ok(DagSpec {
            name,
            period_us,
            deadline_us,
            nodes,
            edges,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::DagLimits;

    /// RTDAG's minimal example, written out from the format: a diamond n000 → {n001, n002} →
    /// n003, period and deadline 3 ms, per-task deadlines of 1 ms.
    const MINIMAL: &str = r#"dag_name: "minimal_yaml"
n_tasks: 4
n_edges: 4
n_cpus: 8
max_out_edges: 2
max_in_edges:  2
max_msg_len: 64
repetitions: 2000 # iterations of the whole DAG
hyperperiod: 3000
dag_period: 3000 # in us
dag_deadline: 3000 # in us
tasks_name: ["n000","n001","n002","n003"]
tasks_expected_wcet_ratio: [.95]
tasks_matrix_size: [4, 4, 4, 4]
tasks_omp_target: [0,0,0,0]
tasks_ticks_per_us: [0,0,0,0]
tasks_type: ["cpu","cpu","cpu","cpu"]
tasks_wcet: [500,500,500,500] # in us
tasks_runtime: [500,500,500,500] # in us
tasks_rel_deadline: [1000,1000,1000,1000] # in us
tasks_affinity: [1,2,2,3]
cpus_freq: [1000,1000,1000,1000,200,200,200,200]
adjacency_matrix: [
                     [0,30,50, 0],
                     [0, 0, 0,32],
                     [0, 0, 0,32],
                     [0, 0, 0, 0],
                  ]
"#;

    #[test]
    fn reads_the_minimal_example() {
        let dags = parse_str(MINIMAL, "minimal.yaml").unwrap();
        assert_eq!(dags.len(), 1);
        let dag = &dags[0];
        assert_eq!(dag.name, "minimal_yaml");
        assert_eq!(dag.period_us, 3_000);
        assert_eq!(dag.deadline_us, Some(3_000));
        assert_eq!(dag.nodes.len(), 4);
        assert_eq!(dag.nodes[2].name, "n002");
        assert_eq!(dag.nodes[2].wcet_us, 500);
        assert_eq!(dag.nodes[2].relative_deadline_us, Some(1_000));
        assert_eq!(dag.nodes[2].device_kind.as_deref(), Some("cpu"));
        assert_eq!(dag.edges, vec![(0, 1), (0, 2), (1, 3), (2, 3)]);

        let validated = dag.validate(&DagLimits::default()).unwrap();
        assert_eq!(validated.critical_path().wcet_us, 1_500);
        // Declared deadlines are kept: the windows are [0, 1], [1, 2], [1, 2], [2, 3] ms.
        let offsets: Vec<u64> = validated
            .timings()
            .iter()
            .map(|timing| timing.release_offset_us)
            .collect();
        assert_eq!(offsets, vec![0, 1_000, 1_000, 2_000]);
    }

    /// A key spelt almost like a field is refused naming it (audit C-D4: `dag_dealine` was
    /// ignored and the deadline silently became the period); RTDAG's own emulator keys and keys
    /// far from every field are still ignored.
    #[test]
    fn a_misspelt_field_is_refused_and_other_keys_are_ignored() {
        for (typo, field) in [
            ("dag_dealine: 3000", "dag_deadline"),
            ("tasks_rel_dedline: [1000,1000,1000,1000]", "tasks_rel_deadline"),
            ("DAG-Deadline: 3000", "dag_deadline"),
        ] {
            let text = MINIMAL.replace("dag_deadline: 3000", typo);
            match parse_str(&text, "typo.yaml") {
                Err(RtdagError::Misspelt {
                    key,
                    field: named,
                    line,
                    ..
                }) => {
                    assert_eq!(named, field, "{typo}");
                    assert_eq!(format!("{key}:"), typo.split_whitespace().next().unwrap());
                    assert!(
                        text.lines().nth(line - 1).unwrap().starts_with(typo),
                        "{typo}: line {line}"
                    );
                }
                other => panic!("{typo}: {other:?}"),
            }
        }
        let text = format!("{MINIMAL}hyperperiod: 3000\nn_edges: 4\ntasks_affinity: [0,0,0,0]\nmy_own_note: hello\n");
        assert_eq!(parse_str(&text, "extra.yaml").unwrap()[0].deadline_us, Some(3_000));
    }

    #[test]
    fn several_documents_are_several_dags() {
        let second = MINIMAL.replace("minimal_yaml", "second");
        let text = format!("{MINIMAL}---\n{second}");
        let dags = parse_str(&text, "two.yaml").unwrap();
        assert_eq!(
            dags.iter().map(|dag| dag.name.as_str()).collect::<Vec<_>>(),
            vec!["minimal_yaml", "second"]
        );
    }

    #[test]
    fn a_short_array_names_its_line_and_the_count() {
        let text = MINIMAL.replace("tasks_wcet: [500,500,500,500]", "tasks_wcet: [500,500,500]");
        let error = parse_str(&text, "short.yaml").unwrap_err();
        assert!(
            matches!(
                error,
                RtdagError::WrongLength {
                    line: 18,
                    field: "tasks_wcet",
                    found: 3,
                    expected: 4,
                    ..
                }
            ),
            "{error}"
        );
        assert!(
            error
                .to_string()
                .starts_with("short.yaml:18: 'tasks_wcet' has 3 entries"),
            "{error}"
        );
    }

    #[test]
    fn n_tasks_must_agree_with_the_names() {
        let text = MINIMAL.replace("n_tasks: 4", "n_tasks: 5");
        let error = parse_str(&text, "count.yaml").unwrap_err();
        assert!(
            matches!(
                error,
                RtdagError::WrongLength {
                    field: "tasks_name",
                    reference: "n_tasks",
                    ..
                }
            ),
            "{error}"
        );
    }

    #[test]
    fn a_missing_field_is_named() {
        let text = MINIMAL.replace("dag_period: 3000 # in us\n", "");
        let error = parse_str(&text, "missing.yaml").unwrap_err();
        assert!(
            matches!(
                error,
                RtdagError::MissingField {
                    field: "dag_period",
                    document: 1,
                    ..
                }
            ),
            "{error}"
        );
    }

    #[test]
    fn a_negative_wcet_is_refused_with_its_index() {
        let text = MINIMAL.replace("tasks_wcet: [500,500,500,500]", "tasks_wcet: [500,-5,500,500]");
        let error = parse_str(&text, "negative.yaml").unwrap_err();
        assert!(
            matches!(
                error,
                RtdagError::BadValue {
                    line: 18,
                    field: "tasks_wcet",
                    index: Some(1),
                    ..
                }
            ),
            "{error}"
        );
        assert!(error.to_string().contains("tasks_wcet[1] is -5"), "{error}");
    }

    #[test]
    fn a_ragged_matrix_is_refused() {
        let text = MINIMAL.replace(
            "[0, 0, 0,32],\n                     [0, 0, 0,32]",
            "[0, 0, 0,32],\n                     [0, 0, 32]",
        );
        let error = parse_str(&text, "ragged.yaml").unwrap_err();
        assert!(
            matches!(
                error,
                RtdagError::BadValue {
                    field: "adjacency_matrix",
                    index: Some(2),
                    ..
                }
            ),
            "{error}"
        );
    }

    #[test]
    fn text_where_a_number_belongs_gives_line_and_field() {
        let text = MINIMAL.replace("dag_period: 3000", "dag_period: soon");
        let error = parse_str(&text, "typed.yaml").unwrap_err();
        let RtdagError::Yaml { line, message, .. } = &error else {
            panic!("{error}")
        };
        assert_eq!(*line, Some(10));
        assert!(message.contains("dag_period"), "{message}");
        assert!(error.to_string().starts_with("typed.yaml:10:"), "{error}");
    }

    #[test]
    fn broken_yaml_and_empty_files_are_reported() {
        assert!(matches!(
            parse_str("# nothing\n", "empty.yaml"),
            Err(RtdagError::Empty { .. })
        ));
        let error = parse_str("dag_name: [unclosed\n", "broken.yaml").unwrap_err();
        assert!(matches!(error, RtdagError::Yaml { .. }), "{error}");
        let error = read_file(Path::new("/nonexistent/rtdag.yaml")).unwrap_err();
        assert!(matches!(error, RtdagError::Io { .. }), "{error}");
    }
}
