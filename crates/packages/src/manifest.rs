//! Reading a manifest: the TOML text into checked kernel entries, every error naming the file,
//! the line and the key. Shared by packages (with a `[package]` table and files) and tenant
//! programs (`[kernels.NAME]` tables only; the code comes with the build request).
//!
//! Must not: read files or load libraries (the package loader does, with the entries' spans
//! for its messages).

use std::ops::Range;

use agora_protocol::{Access, ParamKind, ScalarType, MAX_ARGS};
use toml::de::{DeTable, DeValue};
use toml::Spanned;

use crate::expr::{self, Ty};
use crate::rules::{self, Rules, Slot};
use crate::PackageError;

/// Longest name (package, kernel, parameter, symbol, entry point) accepted.
pub(crate) const MAX_NAME: usize = 256;

/// Longest `doc` accepted (it travels in every kernel listing).
pub(crate) const MAX_DOC: usize = 4096;

/// Default cost estimate, nanoseconds per work item.
pub(crate) const DEFAULT_COST_NS: f64 = 10.0;

/// The manifest text and the name of its file, for messages.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Source<'a> {
    pub file: &'a str,
    pub text: &'a str,
}

impl Source<'_> {
    /// The 1-based line of byte `offset`.
    pub(crate) fn line(&self, offset: usize) -> usize {
        let end = offset.min(self.text.len());
        self.text.as_bytes()[..end].iter().filter(|b| **b == b'\n').count() + 1
    }

    /// An error at `span` about `key`.
    pub(crate) fn error(&self, span: &Range<usize>, key: &str, message: impl Into<String>) -> PackageError {
        PackageError::Manifest {
            file: self.file.to_string(),
            line: self.line(span.start),
            key: key.to_string(),
            message: message.into(),
        }
    }

    /// A TOML syntax error (including a key or table defined twice), with the key found on its
    /// line.
    fn syntax(&self, error: &toml::de::Error) -> PackageError {
        let span = error.span().unwrap_or(0..0);
        let start = self.text[..span.start.min(self.text.len())]
            .rfind('\n')
            .map_or(0, |i| i + 1);
        let line_text = self.text[start..].lines().next().unwrap_or("").trim();
        let key = if let Some(header) = line_text.strip_prefix('[') {
            header.trim_start_matches('[').split(']').next().unwrap_or("").trim()
        } else if let Some((key, _)) = line_text.split_once('=') {
            key.trim()
        } else {
            self.text.get(span.clone()).unwrap_or("").trim()
        };
        let key = if key.is_empty() { "(document)" } else { key };
        let mut message = error.message().trim().to_string();
        if message == "duplicate key" {
            message = format!("`{key}` is defined twice (each kernel and each key may appear once)");
        }
        self.error(&span, key, message)
    }
}

/// A value with where it was written.
#[derive(Debug, Clone)]
pub(crate) struct Located<T> {
    pub value: T,
    /// The value's span in the text.
    pub span: Range<usize>,
    /// The dotted key, e.g. `kernels.scale.opencl.file`.
    pub key: String,
}

/// Whether the manifest describes a package or a tenant program.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    Package,
    Program,
}

/// The `[package]` table.
#[derive(Debug, Clone)]
pub(crate) struct PackageTable {
    pub name: String,
    pub version: Option<String>,
    pub library: Option<Located<String>>,
}

/// An `opencl = { ... }` table.
#[derive(Debug, Clone)]
pub(crate) struct OpenClEntry {
    /// The `.cl` file (packages only).
    pub file: Option<Located<String>>,
    /// The entry point (the kernel's name when not given).
    pub entry: Located<String>,
    pub local: Option<[usize; 3]>,
    /// Precompiled programs: (device name, file relative to the package), packages only.
    pub binaries: Vec<(String, Located<String>)>,
}

/// A `cuda = { ... }` table.
#[derive(Debug, Clone)]
pub(crate) struct CudaEntry {
    /// The `.cu` (CUDA C) or `.ptx` file (packages only).
    pub file: Option<Located<String>>,
    /// The entry point (the kernel's name when not given).
    pub entry: Located<String>,
    /// Where the table is (the `cuda` key) and its dotted key, for errors about the kernel's
    /// calling convention.
    pub span: Range<usize>,
    pub key: String,
}

/// One `[kernels.NAME]` table, checked.
#[derive(Debug, Clone)]
pub(crate) struct KernelEntry {
    pub name: String,
    pub doc: String,
    pub params: Vec<(String, ParamKind)>,
    pub dims: usize,
    pub chunkable: bool,
    pub cost_ns: f64,
    pub rules: Rules,
    pub opencl: Option<OpenClEntry>,
    pub cuda: Option<CudaEntry>,
    /// The `cpu` table's symbol (the kernel's name when not given).
    pub cpu: Option<Located<String>>,
    /// Everything the entry says, in a fixed form (for fingerprints).
    pub canonical: String,
}

/// A parsed manifest.
#[derive(Debug)]
pub(crate) struct Manifest {
    pub package: Option<PackageTable>,
    pub kernels: Vec<KernelEntry>,
}

/// A table being read, with its dotted key.
struct Table<'s, 't, 'i> {
    src: Source<'s>,
    key: String,
    table: &'t DeTable<'i>,
    span: Range<usize>,
}

type Entry<'t, 'i> = (&'t Spanned<std::borrow::Cow<'i, str>>, &'t Spanned<DeValue<'i>>);

impl<'s, 't, 'i> Table<'s, 't, 'i> {
    fn path(&self, key: &str) -> String {
        if self.key.is_empty() {
            key.to_string()
        } else {
            format!("{}.{key}", self.key)
        }
    }

    /// Refuses keys outside `allowed`.
    fn only(&self, allowed: &[&str]) -> Result<(), PackageError> {
        for (k, _) in self.table.iter() {
            if !allowed.contains(&k.get_ref().as_ref()) {
                return Err(self.src.error(
                    &k.span(),
                    &self.path(k.get_ref()),
                    format!(
                        "unknown key `{}` (this table takes: {})",
                        k.get_ref(),
                        allowed.join(", ")
                    ),
                ));
            }
        }
        Ok(())
    }

    fn get(&self, key: &str) -> Option<Entry<'t, 'i>> {
        self.table.iter().find(|(k, _)| k.get_ref().as_ref() == key)
    }

    fn wrong_type(&self, key: &str, value: &Spanned<DeValue<'_>>, want: &str) -> PackageError {
        self.src.error(
            &value.span(),
            &self.path(key),
            format!("must be {want}, not {}", describe(value.get_ref())),
        )
    }

    fn string(&self, key: &str) -> Result<Option<Located<String>>, PackageError> {
        let Some((_, value)) = self.get(key) else {
            return Ok(None);
        };
        match value.get_ref() {
            DeValue::String(s) => Ok(Some(Located {
                value: s.to_string(),
                span: value.span(),
                key: self.path(key),
            })),
            _ => Err(self.wrong_type(key, value, "a string")),
        }
    }

    fn required_string(&self, key: &str) -> Result<Located<String>, PackageError> {
        self.string(key)?.ok_or_else(|| {
            self.src
                .error(&self.span, &self.path(key), format!("`{key}` is missing"))
        })
    }

    fn boolean(&self, key: &str) -> Result<Option<bool>, PackageError> {
        let Some((_, value)) = self.get(key) else {
            return Ok(None);
        };
        value
            .get_ref()
            .as_bool()
            .map(Some)
            .ok_or_else(|| self.wrong_type(key, value, "true or false"))
    }

    fn integer(&self, key: &str, value: &Spanned<DeValue<'_>>) -> Result<i64, PackageError> {
        match value.get_ref() {
            DeValue::Integer(i) => i64::from_str_radix(i.as_str(), i.radix()).map_err(|_| {
                self.src
                    .error(&value.span(), &self.path(key), "the integer is too large")
            }),
            _ => Err(self.wrong_type(key, value, "an integer")),
        }
    }

    fn number(&self, key: &str) -> Result<Option<Located<f64>>, PackageError> {
        let Some((_, value)) = self.get(key) else {
            return Ok(None);
        };
        let number = match value.get_ref() {
            DeValue::Integer(_) => self.integer(key, value)? as f64,
            DeValue::Float(f) => f.as_str().replace('_', "").parse::<f64>().unwrap_or(f64::NAN),
            _ => return Err(self.wrong_type(key, value, "a number")),
        };
        Ok(Some(Located {
            value: number,
            span: value.span(),
            key: self.path(key),
        }))
    }

    fn array(&self, key: &str) -> Result<Option<Vec<&'t Spanned<DeValue<'i>>>>, PackageError> {
        let Some((_, value)) = self.get(key) else {
            return Ok(None);
        };
        match value.get_ref() {
            DeValue::Array(items) => Ok(Some(items.iter().collect())),
            _ => Err(self.wrong_type(key, value, "an array")),
        }
    }

    fn strings(&self, key: &str) -> Result<Vec<Located<String>>, PackageError> {
        let mut out = Vec::new();
        for (i, item) in self.array(key)?.unwrap_or_default().into_iter().enumerate() {
            let path = format!("{}[{i}]", self.path(key));
            match item.get_ref() {
                DeValue::String(s) => out.push(Located {
                    value: s.to_string(),
                    span: item.span(),
                    key: path,
                }),
                other => {
                    return Err(self.src.error(
                        &item.span(),
                        &path,
                        format!("must be a string, not {}", describe(other)),
                    ))
                }
            }
        }
        Ok(out)
    }

    fn table(&self, key: &str) -> Result<Option<Table<'s, 't, 'i>>, PackageError> {
        let Some((k, value)) = self.get(key) else {
            return Ok(None);
        };
        match value.get_ref() {
            DeValue::Table(table) => Ok(Some(Table {
                src: self.src,
                key: self.path(key),
                table,
                span: span_of(k, value),
            })),
            _ => Err(self.wrong_type(key, value, "a table")),
        }
    }
}

/// Where a table entry is best reported: its value's span for `[header]` tables (the header),
/// else its key's.
fn span_of(key: &Spanned<std::borrow::Cow<'_, str>>, value: &Spanned<DeValue<'_>>) -> Range<usize> {
    if value.span().start < key.span().start {
        value.span()
    } else {
        key.span()
    }
}

fn describe(value: &DeValue<'_>) -> String {
    match value {
        DeValue::String(s) => format!("the string \"{s}\""),
        DeValue::Integer(i) => format!("the integer {i}"),
        DeValue::Float(f) => format!("the float {f}"),
        DeValue::Boolean(b) => format!("the boolean {b}"),
        DeValue::Datetime(d) => format!("the date {d}"),
        DeValue::Array(_) => "an array".into(),
        DeValue::Table(_) => "a table".into(),
    }
}

/// Whether `name` is an identifier (letters, digits, `_`, not starting with a digit).
fn is_identifier(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

fn check_name(src: &Source<'_>, span: &Range<usize>, key: &str, name: &str, what: &str) -> Result<(), PackageError> {
    if name.len() > MAX_NAME {
        return Err(src.error(
            span,
            key,
            format!("the {what} is {} bytes long; at most {MAX_NAME}", name.len()),
        ));
    }
    if !is_identifier(name) {
        return Err(src.error(
            span,
            key,
            format!("the {what} `{name}` is not an identifier (letters, digits and _, not starting with a digit)"),
        ));
    }
    Ok(())
}

fn scalar_type(name: &str) -> Option<ScalarType> {
    Some(match name {
        "i32" => ScalarType::I32,
        "u32" => ScalarType::U32,
        "i64" => ScalarType::I64,
        "u64" => ScalarType::U64,
        "f32" => ScalarType::F32,
        "f64" => ScalarType::F64,
        _ => return None,
    })
}

/// One `params` entry: `name: type` or `name: type read|write|readwrite`.
fn param(src: &Source<'_>, item: &Located<String>) -> Result<(String, ParamKind), PackageError> {
    let bad = |message: String| src.error(&item.span, &item.key, message);
    let Some((name, rest)) = item.value.split_once(':') else {
        return Err(bad(format!(
            "`{}` is not a parameter: write `name: type` for a scalar or `name: type read|write|readwrite` for a buffer",
            item.value
        )));
    };
    let name = name.trim();
    check_name(src, &item.span, &item.key, name, "parameter name")?;
    if matches!(name, "range0" | "range1" | "range2" | "true" | "false") || name.starts_with("len_") {
        return Err(bad(format!(
            "the parameter name `{name}` is reserved (size rules use range0..range2 and len_<buffer>)"
        )));
    }
    let words: Vec<&str> = rest.split_whitespace().collect();
    let Some(ty) = words.first() else {
        return Err(bad(format!("parameter `{name}` has no type")));
    };
    let ty = scalar_type(ty).ok_or_else(|| {
        bad(format!(
            "unknown scalar type `{ty}` for parameter `{name}` (one of i32, u32, i64, u64, f32, f64)"
        ))
    })?;
    let kind = match words[1..] {
        [] => ParamKind::Scalar(ty),
        [access] => ParamKind::Buffer {
            element: ty,
            access: match access {
                "read" => Access::Read,
                "write" => Access::Write,
                "readwrite" | "read-write" => Access::ReadWrite,
                other => {
                    return Err(bad(format!(
                        "unknown access `{other}` for buffer `{name}` (read, write or readwrite)"
                    )))
                }
            },
        },
        _ => {
            return Err(bad(format!(
                "`{}` has too many words: write `name: type` or `name: type read|write|readwrite`",
                item.value
            )))
        }
    };
    Ok((name.to_string(), kind))
}

/// Parses `text` (the manifest `file`).
pub(crate) fn parse(file: &str, text: &str, mode: Mode) -> Result<Manifest, PackageError> {
    let src = Source { file, text };
    let doc = DeTable::parse(text).map_err(|e| src.syntax(&e))?;
    let root = Table {
        src,
        key: String::new(),
        table: doc.get_ref(),
        span: 0..0,
    };
    let package = match mode {
        Mode::Package => {
            root.only(&["package", "kernels"])?;
            let table = root.table("package")?.ok_or_else(|| {
                src.error(
                    &(0..0),
                    "package",
                    "the [package] table is missing (it names the package)",
                )
            })?;
            table.only(&["name", "version", "library"])?;
            let name = table.required_string("name")?;
            if name.value.is_empty()
                || name.value.len() > MAX_NAME
                || !name
                    .value
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
            {
                return Err(src.error(
                    &name.span,
                    &name.key,
                    format!(
                        "the package name `{}` must be 1 to {MAX_NAME} characters of a-z, 0-9 and _",
                        name.value
                    ),
                ));
            }
            let version = table.string("version")?.map(|v| v.value);
            let library = table.string("library")?;
            if let Some(library) = &library {
                if library.value.trim().is_empty() {
                    return Err(src.error(&library.span, &library.key, "the library path is empty"));
                }
            }
            Some(PackageTable {
                name: name.value,
                version,
                library,
            })
        }
        Mode::Program => {
            if let Some((k, _)) = root.get("package") {
                return Err(src.error(
                    &k.span(),
                    "package",
                    "a program's manifest has no [package] table (only [kernels.NAME] tables; the code comes with the program)",
                ));
            }
            root.only(&["kernels"])?;
            None
        }
    };
    let kernels_table = root.table("kernels")?;
    let mut kernels = Vec::new();
    if let Some(table) = &kernels_table {
        let mut entries: Vec<Entry<'_, '_>> = table.table.iter().collect();
        entries.sort_by_key(|(k, v)| span_of(k, v).start);
        for (k, v) in entries {
            let name = k.get_ref().to_string();
            let key = table.path(&name);
            check_name(&src, &span_of(k, v), &key, &name, "kernel name")?;
            let DeValue::Table(t) = v.get_ref() else {
                return Err(table.wrong_type(&name, v, "a table ([kernels.NAME])"));
            };
            let t = Table {
                src,
                key,
                table: t,
                span: span_of(k, v),
            };
            kernels.push(kernel(&t, name, mode, package.as_ref())?);
        }
    }
    if kernels.is_empty() {
        let span = kernels_table.as_ref().map_or(0..0, |t| t.span.clone());
        return Err(src.error(
            &span,
            "kernels",
            "the manifest defines no kernel ([kernels.NAME] tables)",
        ));
    }
    Ok(Manifest { package, kernels })
}

fn kernel(
    t: &Table<'_, '_, '_>,
    name: String,
    mode: Mode,
    package: Option<&PackageTable>,
) -> Result<KernelEntry, PackageError> {
    let src = t.src;
    t.only(&[
        "doc",
        "params",
        "dims",
        "sizes",
        "range",
        "require",
        "chunkable",
        "cost_ns_per_item",
        "opencl",
        "cuda",
        "cpu",
    ])?;
    let doc = match t.string("doc")? {
        None => String::new(),
        Some(d) if d.value.len() > MAX_DOC => {
            return Err(src.error(
                &d.span,
                &d.key,
                format!("the doc is {} bytes long; at most {MAX_DOC}", d.value.len()),
            ))
        }
        Some(d) => d.value,
    };
    let items = t.strings("params")?;
    if items.len() > MAX_ARGS {
        let (_, value) = t.get("params").expect("params exist when there are items");
        return Err(src.error(
            &value.span(),
            &t.path("params"),
            format!("{} parameters; a kernel takes at most {MAX_ARGS}", items.len()),
        ));
    }
    let mut params: Vec<(String, ParamKind)> = Vec::new();
    for item in &items {
        let p = param(&src, item)?;
        if params.iter().any(|(n, _)| *n == p.0) {
            return Err(src.error(&item.span, &item.key, format!("parameter `{}` is declared twice", p.0)));
        }
        params.push(p);
    }
    let dims = match t.get("dims") {
        None => 1,
        Some((_, value)) => {
            let d = t.integer("dims", value)?;
            if !(1..=3).contains(&d) {
                return Err(src.error(
                    &value.span(),
                    &t.path("dims"),
                    format!("dims is {d}; it must be 1, 2 or 3"),
                ));
            }
            d as usize
        }
    };
    let slots: Vec<(String, Slot)> = params
        .iter()
        .map(|(n, kind)| {
            let slot = match kind {
                ParamKind::Scalar(t) => Slot::Scalar(*t),
                ParamKind::Buffer { element, .. } => Slot::Buffer(element.size()),
            };
            (n.clone(), slot)
        })
        .collect();
    let known = rules::variables(&slots, dims);
    let mut rules = Rules::new(name.clone(), dims, slots.iter().map(|(_, s)| *s).collect());
    let mut canonical = format!("kernel {name}\ndoc {doc:?}\nparams {params:?}\ndims {dims}\n");
    for item in t.strings("require")? {
        let e = expr::compile(&item.value, Ty::Bool, &known).map_err(|m| src.error(&item.span, &item.key, m))?;
        canonical.push_str(&format!("require {:?}\n", item.value));
        rules.require(e);
    }
    let range = t.strings("range")?;
    if range.len() > dims {
        let (_, value) = t.get("range").expect("range exists when there are items");
        return Err(src.error(
            &value.span(),
            &t.path("range"),
            format!("{} extents for a kernel of {dims} dimension(s) (dims)", range.len()),
        ));
    }
    for item in range {
        let e = expr::compile(&item.value, Ty::Number, &known).map_err(|m| src.error(&item.span, &item.key, m))?;
        canonical.push_str(&format!("range {:?}\n", item.value));
        rules.range(e);
    }
    let sizes = t.table("sizes")?;
    let mut sized = vec![false; params.len()];
    if let Some(sizes) = &sizes {
        let mut entries: Vec<Entry<'_, '_>> = sizes.table.iter().collect();
        entries.sort_by_key(|(k, _)| k.span().start);
        for (k, v) in entries {
            let buffer = k.get_ref().as_ref();
            let key = sizes.path(buffer);
            let Some(index) = params.iter().position(|(n, _)| n == buffer) else {
                let names: Vec<&str> = params.iter().map(|(n, _)| n.as_str()).collect();
                return Err(src.error(
                    &k.span(),
                    &key,
                    format!(
                        "size rule for `{buffer}`, which is not a parameter of this kernel (parameters: {})",
                        names.join(", ")
                    ),
                ));
            };
            if matches!(params[index].1, ParamKind::Scalar(_)) {
                return Err(src.error(
                    &k.span(),
                    &key,
                    format!("`{buffer}` is a scalar; size rules are for buffers (use `require` for scalars)"),
                ));
            }
            let DeValue::String(text) = v.get_ref() else {
                return Err(sizes.wrong_type(buffer, v, "a string (an expression)"));
            };
            let e = expr::compile(text, Ty::Number, &known).map_err(|m| src.error(&v.span(), &key, m))?;
            canonical.push_str(&format!("size {buffer} {text:?}\n"));
            rules.size(index, e);
            sized[index] = true;
        }
    }
    if let Some(((buffer, _), _)) = params
        .iter()
        .zip(&sized)
        .find(|((_, kind), sized)| matches!(kind, ParamKind::Buffer { .. }) && !**sized)
    {
        let span = sizes.as_ref().map_or(t.span.clone(), |s| s.span.clone());
        return Err(src.error(
            &span,
            &t.path("sizes"),
            format!("buffer `{buffer}` has no size rule (e.g. sizes = {{ {buffer} = \"range0\" }}: its least length in elements)"),
        ));
    }
    let chunkable = t.boolean("chunkable")?.unwrap_or(false);
    let cost_ns = match t.number("cost_ns_per_item")? {
        None => DEFAULT_COST_NS,
        Some(c) if c.value.is_finite() && c.value > 0.0 => c.value,
        Some(c) => {
            return Err(src.error(
                &c.span,
                &c.key,
                format!("the cost must be a positive number of nanoseconds, not {}", c.value),
            ))
        }
    };
    canonical.push_str(&format!("chunkable {chunkable}\ncost {cost_ns}\n"));
    let opencl = match t.table("opencl")? {
        None => None,
        Some(cl) => {
            let allowed: &[&str] = match mode {
                Mode::Package => &["file", "entry", "local", "binaries"],
                Mode::Program => &["entry", "local"],
            };
            cl.only(allowed)?;
            let file = match mode {
                Mode::Package => Some(cl.required_string("file")?),
                Mode::Program => None,
            };
            let entry = cl.string("entry")?.unwrap_or_else(|| Located {
                value: name.clone(),
                span: cl.span.clone(),
                key: cl.key.clone(),
            });
            check_name(&src, &entry.span, &entry.key, &entry.value, "OpenCL entry point")?;
            let local = match cl.array("local")? {
                None => None,
                Some(items) => {
                    let key = cl.path("local");
                    let (_, value) = cl.get("local").expect("local exists");
                    if items.is_empty() || items.len() > 3 {
                        return Err(src.error(&value.span(), &key, "local must list 1 to 3 work-group extents"));
                    }
                    let mut local = [1usize; 3];
                    for (d, item) in items.iter().enumerate() {
                        let v = cl.integer("local", item)?;
                        if !(1..=1024).contains(&v) {
                            return Err(src.error(
                                &item.span(),
                                &format!("{key}[{d}]"),
                                format!("work-group extent {v}; it must be 1 to 1024"),
                            ));
                        }
                        local[d] = v as usize;
                    }
                    Some(local)
                }
            };
            let mut binaries = Vec::new();
            if let Some(table) = cl.table("binaries")? {
                let mut entries: Vec<Entry<'_, '_>> = table.table.iter().collect();
                entries.sort_by_key(|(k, _)| k.span().start);
                for (k, v) in entries {
                    let device = k.get_ref().as_ref().to_string();
                    let key = table.path(&device);
                    let DeValue::String(path) = v.get_ref() else {
                        return Err(table.wrong_type(&device, v, "a string (the binary's file)"));
                    };
                    if device.is_empty() || device.len() > 256 {
                        return Err(src.error(&k.span(), &key, "a device name of 1 to 256 bytes (CL_DEVICE_NAME)"));
                    }
                    canonical.push_str(&format!("binary {device:?} {path:?}\n"));
                    binaries.push((
                        device,
                        Located {
                            value: path.to_string(),
                            span: v.span(),
                            key,
                        },
                    ));
                }
            }
            canonical.push_str(&format!(
                "opencl {:?} {:?} {local:?}\n",
                file.as_ref().map(|f| &f.value),
                entry.value
            ));
            Some(OpenClEntry {
                file,
                entry,
                local,
                binaries,
            })
        }
    };
    let cuda = match t.table("cuda")? {
        None => None,
        Some(cu) => {
            let file = match mode {
                Mode::Package => {
                    cu.only(&["file", "entry"])?;
                    let file = cu.required_string("file")?;
                    if file.value.trim().is_empty() {
                        return Err(src.error(&file.span, &file.key, "the file name is empty"));
                    }
                    Some(file)
                }
                Mode::Program => {
                    cu.only(&["entry"])?;
                    None
                }
            };
            let entry = cu.string("entry")?.unwrap_or_else(|| Located {
                value: name.clone(),
                span: cu.span.clone(),
                key: cu.key.clone(),
            });
            check_name(&src, &entry.span, &entry.key, &entry.value, "CUDA entry point")?;
            canonical.push_str(&format!(
                "cuda {:?} {:?}\n",
                file.as_ref().map(|f| &f.value),
                entry.value
            ));
            Some(CudaEntry {
                file,
                entry,
                span: cu.span.clone(),
                key: cu.key.clone(),
            })
        }
    };
    let cpu = match t.table("cpu")? {
        None => None,
        Some(cpu) => {
            cpu.only(&["symbol"])?;
            if mode == Mode::Package && package.is_some_and(|p| p.library.is_none()) {
                return Err(src.error(
                    &cpu.span,
                    &cpu.key,
                    "a C implementation needs the shared object it is in: add `library = \"libNAME.so\"` to [package]",
                ));
            }
            let symbol = cpu.string("symbol")?.unwrap_or_else(|| Located {
                value: name.clone(),
                span: cpu.span.clone(),
                key: cpu.key.clone(),
            });
            check_name(&src, &symbol.span, &symbol.key, &symbol.value, "symbol")?;
            canonical.push_str(&format!("cpu {:?}\n", symbol.value));
            Some(symbol)
        }
    };
    if mode == Mode::Package && opencl.is_none() && cuda.is_none() && cpu.is_none() {
        return Err(src.error(
            &t.span,
            &t.key,
            format!("kernel `{name}` has no implementation: give `opencl = {{ file = \"...\", entry = \"...\" }}`, `cuda = {{ file = \"...\", entry = \"...\" }}`, `cpu = {{ symbol = \"...\" }}`, or several"),
        ));
    }
    Ok(KernelEntry {
        name,
        doc,
        params,
        dims,
        chunkable,
        cost_ns,
        rules,
        opencl,
        cuda,
        cpu,
        canonical,
    })
}
