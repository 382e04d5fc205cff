//! Fencing tenant PTX: rewriting a module so that every access it makes to global memory stays
//! inside the tenant's partition of device memory, Guardian's scheme (address masking, Pavlidakis
//! et al., "Guardian: Safe GPU Sharing in Multi-Tenant Environments", Middleware 2024).
//!
//! What this module owns: the rewrite ([`fence`]), an independent check of its output
//! ([`check_fenced`]) and the launch arguments the rewrite expects ([`fence_arguments`]). It reads
//! and writes text only: it must not load, assemble or launch anything (the caller loads the
//! fenced PTX and passes the arguments).
//!
//! The scheme: the launcher gives each tenant a partition of `2^k` bytes at a base `B` aligned to
//! its size, and passes `B` and the mask `M = 2^k - 1` as two extra kernel parameters, which the
//! rewrite appends to every `.entry`. Before each global access the kernel computes the effective
//! address `a`, then `(a & M) | B`: an address inside the partition is unchanged, any other lands
//! inside it. Generic accesses (no state space: `ld.f32 [%rd]`) are masked only when
//! `isspacep.global` says the address is global, so generic pointers to shared or local memory
//! keep working.
//!
//! The rewrite also makes every kernel stoppable, so a tenant's endless loop ends at the
//! per-launch limit instead of holding the GPU: each `.entry` takes two more parameters (the
//! address of its lane's stop word and the launch's number), and before each backward branch (a
//! loop's) and each indirect branch every thread counts, and every [`POLL_EVERY`]th time reads the
//! stop word and exits when it holds its launch's number. The launcher writes that number when
//! the launch has run too long. Device functions may not loop (they get no parameters); a kernel
//! without loops ends on its own.
//!
//! Why masking rather than a bounds check that traps: a trap, like an illegal address, leaves the
//! CUDA context unusable for every stream in it, so one tenant's stray pointer would take down the
//! kernels of every tenant sharing the GPU; a masked address never faults (Guardian, §3). A stray
//! access therefore reads or writes the tenant's own partition.
//!
//! What it protects: other tenants' device memory (and the daemon's) from a tenant's kernels,
//! through global, generic, atomic and reduction accesses, given that the partition is mapped in
//! full and that the launcher passes the arguments. What it does not protect:
//! * a tenant from itself: a masked stray access may corrupt the tenant's own buffers;
//! * the GPU's time: infinite loops are the per-launch timeout's job;
//! * faults that do not need a foreign address: a misaligned access stays misaligned (masking keeps
//!   the low bits), `trap` still traps; those end in the device-failure path. Natural alignment is
//!   also what keeps a vector access from straddling the partition's end, hence
//!   [`MIN_PARTITION_BYTES`];
//! * shared and local memory are not fenced: they are per block and per thread, and the hardware
//!   checks them against the block's and thread's windows.
//!
//! What it refuses ([`FenceError::Unsupported`]): device functions that loop or recurse, calls
//! through function pointers (their callee could recurse unseen),
//! instructions that reach global memory without an address the pass can mask (asynchronous and
//! bulk copies, tensor maps, textures and surfaces, prefetch and cache control, multimem, `st.async`/`red.async`, `wmma`/`ldmatrix`/`mbarrier` on
//! non-shared addresses), device functions (`.func`) that touch global or generic memory (they
//! have no fence parameters: inline them), calls to functions whose body is not in the module
//! (`printf`, `malloc`: the pass cannot see what they touch), generic accesses to a variable by
//! name, debug sections (`-G`), preprocessor directives, and names in the fence's reserved
//! namespace (`%agora_*`, `*_agora_fence_*`). Address operands handled: `[%reg]`, `[%reg+imm]`
//! (including `+-imm`, which NVRTC emits for negative offsets; PTX has no `[%reg-imm]`),
//! `[var]` and `[var+imm]` for global variables (the address is taken with `mov.u64`). PTX allows
//! an immediate address (`[1024]`) only for `.local`, so it is refused for global accesses.
//!
//! Parsing is by statement (`;`-terminated, with `{ }` scopes and labels), not by line, so an
//! instruction split over lines (NVRTC does that for `call`) is seen whole; the directives that
//! end at the end of their line (`.loc`, `.file`, `.version`, `.target`, `.address_size`) are
//! checked strictly, since ptxas also accepts an instruction after them on the same line.

use std::fmt;
use std::ops::Range;

/// The smallest partition [`fence_arguments`] accepts. A naturally aligned access of up to this
/// many bytes (the widest PTX vector access is 32 bytes) at a masked address ends inside the
/// partition; 256 leaves room for wider forms.
pub const MIN_PARTITION_BYTES: u64 = 256;

/// Register holding the partition base `B`.
const BASE_REG: &str = "%agora_fb";
/// Register holding the partition mask `M`.
const MASK_REG: &str = "%agora_fm";
/// Register holding the fenced effective address.
const ADDR_REG: &str = "%agora_fa";
/// Predicate: is the generic address global?
const PRED_REG: &str = "%agora_fp";
/// Register holding the address of the lane's stop word (a `u32` the launcher can set while the
/// kernel runs).
const STOP_REG: &str = "%agora_fs";
/// Register holding this launch's number: the kernel stops when the stop word equals it.
const LAUNCH_REG: &str = "%agora_fl";
/// Register counting a thread's backward branches since its last look at the stop word.
const COUNT_REG: &str = "%agora_fn";
/// Register holding the stop word as read.
const WORD_REG: &str = "%agora_ft";
/// Predicate of the stop poll.
const POLL_PRED: &str = "%agora_fq";
/// Suffixes of the four parameters appended to each entry (prefixed by the entry's name, so they
/// are unique in the module).
const BASE_PARAM_SUFFIX: &str = "_agora_fence_base";
const MASK_PARAM_SUFFIX: &str = "_agora_fence_mask";
const STOP_PARAM_SUFFIX: &str = "_agora_fence_stop";
const LAUNCH_PARAM_SUFFIX: &str = "_agora_fence_launch";

/// A thread looks at the stop word once per this many backward branches: a loop iteration pays
/// an add and a compare, and a stopped kernel ends within this many iterations of each thread.
pub const POLL_EVERY: u32 = 1024;

/// The stop poll, inserted right before each backward branch of a kernel (and each indirect
/// branch): every [`POLL_EVERY`]th time, the thread reads the stop word and exits when it holds
/// this launch's number. `(guard, opcode, operands)`, as [`normalized`] gives them.
const POLL: [(&str, &str, &[&str]); 6] = [
    ("", "add.u32", &[COUNT_REG, COUNT_REG, "1"]),
    ("", "setp.ge.u32", &[POLL_PRED, COUNT_REG, "1024"]),
    ("@%agora_fq", "mov.u32", &[COUNT_REG, "0"]),
    ("@%agora_fq", "ld.volatile.global.u32", &[WORD_REG, "[%agora_fs]"]),
    ("@%agora_fq", "setp.eq.u32", &[POLL_PRED, WORD_REG, LAUNCH_REG]),
    ("@%agora_fq", "exit", &[]),
];

/// A fenced module.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fenced {
    /// The rewritten PTX.
    pub ptx: String,
    /// The kernels (`.entry`), in module order, whose parameter lists got the two fence
    /// parameters (`.u64` base, then `.u64` mask) appended: launch them with
    /// [`fence_arguments`] after their own arguments.
    pub entries: Vec<String>,
    /// How many instructions were rewritten to use a fenced address.
    pub fenced_accesses: usize,
}

/// Why a module could not be fenced, or why fenced PTX did not pass [`check_fenced`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FenceError {
    /// The module uses something the pass cannot fence.
    Unsupported {
        /// 1-based line of the statement.
        line: usize,
        /// The statement, whitespace collapsed.
        instruction: String,
        /// Why, and what to do instead.
        why: &'static str,
    },
    /// [`check_fenced`] found a global access without the fence sequence right before it, or a
    /// kernel without its fence parameters.
    Unfenced {
        /// 1-based line of the statement.
        line: usize,
        /// The statement, whitespace collapsed.
        instruction: String,
    },
    /// The text is not PTX the pass understands.
    Malformed {
        /// 1-based line.
        line: usize,
        /// What is wrong.
        why: &'static str,
    },
}

impl fmt::Display for FenceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FenceError::Unsupported { line, instruction, why } => write!(
                f,
                "line {line}: `{instruction}`: {why}. This cannot be fenced: rewrite the kernel without it \
                 (trusted packages may opt out of fencing)"
            ),
            FenceError::Unfenced { line, instruction } => write!(
                f,
                "line {line}: `{instruction}` is not fenced: a global access must use [{ADDR_REG}] computed \
                 right before it (and with {MASK_REG}, or with {BASE_REG}) and each kernel must load its \
                 fence parameters first; pass the original PTX through fence() and do not edit its output"
            ),
            FenceError::Malformed { line, why } => write!(
                f,
                "line {line}: {why}; the fence pass accepts PTX as NVRTC or ptxas-bound compilers emit it"
            ),
        }
    }
}

impl std::error::Error for FenceError {}

/// The two fence arguments (base, mask) for a partition of `size` bytes at `base`, in the order
/// the fenced kernels take them (after their own). `None` unless `size` is a power of two of at
/// least [`MIN_PARTITION_BYTES`] and `base` is a multiple of it (masking relies on both).
pub fn fence_arguments(base: u64, size: u64) -> Option<(u64, u64)> {
    if !size.is_power_of_two() || size < MIN_PARTITION_BYTES || !base.is_multiple_of(size) {
        return None;
    }
    Some((base, size - 1))
}

/// Why-texts of refusals, shared by the rewrite and the check.
mod why {
    pub const RECURSION: &str = "device functions call themselves (directly or through others), and recursion \
                                 cannot be stopped at the per-launch limit; write it as a loop in the kernel";
    pub const INDIRECT_CALL: &str = "calls a function through a pointer, whose callee the pass cannot see (it \
                                     could recurse, which cannot be stopped at the per-launch limit); call \
                                     the function by name";
    pub const FUNC_LOOP: &str = "a device function (.func) loops (a backward or indirect branch), and only \
                                 kernels' loops can be stopped at the per-launch limit; inline it \
                                 (__forceinline__) or move the loop into the kernel";
    pub const FUNC: &str = "a device function (.func) accesses global or generic memory, and only kernels \
                            receive the fence parameters; inline it (__forceinline__) so the access is fenced in \
                            the kernel";
    pub const UNDEFINED_FUNCTION: &str = "declares a function whose body is not in the module (printf, malloc, \
                                          assert and other system calls); the pass cannot see what it touches, \
                                          remove the call";
    pub const ASYNC_COPY: &str = "asynchronous and bulk copies (cp.*) move global memory at addresses the pass \
                                  does not mask; use ordinary loads and stores";
    pub const CACHE_CONTROL: &str = "prefetch and cache control (prefetch, applypriority, discard) act on \
                                     unmasked addresses, and discard can destroy another tenant's data";
    pub const TEXTURE: &str = "textures and surfaces reach memory through handles, not addresses; read the \
                               buffer with ordinary loads";
    pub const MULTIMEM: &str = "multimem instructions reach other devices' memory through multicast addresses";
    pub const TENSORMAP: &str = "tensormap instructions write tensor maps in global memory";
    pub const ASYNC_STORE: &str = "st.async and red.async are not fenced; use ordinary stores";
    pub const BULK: &str = "bulk stores fill a range of memory, and masking fences one address; use ordinary \
                            stores (or the .shared::cta form)";
    pub const NOT_SHARED: &str = "this instruction is only fenced in its .shared form (the address here may be \
                                  global); use the .shared state space or ordinary loads and stores";
    pub const UNKNOWN_ADDRESSING: &str = "this instruction addresses memory in a way the pass does not fence";
    pub const GENERIC_VARIABLE: &str = "a generic access to a variable by name; take its address (cvta) and \
                                        access through a register";
    pub const ADDRESS_SIZE: &str = "fencing needs 64-bit addresses (.address_size 64, as NVRTC emits)";
    pub const RESERVED: &str = "uses a name reserved for the fence (%agora_*, *_agora_fence_*); rename it";
    pub const DEBUG_SECTION: &str = "debug sections are not accepted; compile without -G (-lineinfo is fine)";
}

// ---------------------------------------------------------------------------------------------
// Syntax, shared by the rewrite and the check: tokens, statements, the module's outline. What
// each instruction means for memory is decided separately by each (see `plan_access` and
// `verify_instruction`).
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// Opcodes, directives, registers, identifiers, numbers: `[A-Za-z0-9_$%.]` and `::`.
    Word,
    /// One punctuation character.
    Punct,
    /// A string literal (`.file`, `.pragma`).
    Str,
}

#[derive(Clone, Copy, Debug)]
struct Token<'a> {
    kind: Kind,
    text: &'a str,
    start: usize,
    end: usize,
    line: usize,
}

impl Token<'_> {
    fn is(&self, punct: &str) -> bool {
        self.kind == Kind::Punct && self.text == punct
    }

    fn is_word(&self, word: &str) -> bool {
        self.kind == Kind::Word && self.text == word
    }
}

fn malformed(line: usize, why: &'static str) -> FenceError {
    FenceError::Malformed { line, why }
}

fn is_word_byte(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || matches!(byte, b'_' | b'$' | b'%' | b'.')
}

fn tokenize(ptx: &str) -> Result<Vec<Token<'_>>, FenceError> {
    let bytes = ptx.as_bytes();
    let mut tokens = Vec::new();
    let (mut i, mut line) = (0, 1);
    while i < bytes.len() {
        let start = i;
        let kind = match bytes[i] {
            b'\n' => {
                line += 1;
                i += 1;
                continue;
            }
            b' ' | b'\t' | b'\r' | 0x0b | 0x0c => {
                i += 1;
                continue;
            }
            b'/' if bytes.get(i + 1) == Some(&b'/') => {
                while i < bytes.len() && bytes[i] != b'\n' {
                    i += 1;
                }
                continue;
            }
            b'/' if bytes.get(i + 1) == Some(&b'*') => {
                let close = ptx[i + 2..]
                    .find("*/")
                    .ok_or(malformed(line, "unterminated /* comment"))?;
                let end = i + 2 + close + 2;
                line += ptx[i..end].bytes().filter(|&b| b == b'\n').count();
                i = end;
                continue;
            }
            b'"' => {
                i += 1;
                loop {
                    match bytes.get(i) {
                        None | Some(b'\n') => return Err(malformed(line, "unterminated string")),
                        Some(b'\\') if bytes.get(i + 1) != Some(&b'\n') => i += 2,
                        Some(b'"') => break,
                        Some(_) => i += 1,
                    }
                }
                i += 1;
                Kind::Str
            }
            // ptxas runs a preprocessor: a macro could expand to an instruction this pass never sees.
            b'#' => {
                return Err(malformed(
                    line,
                    "preprocessor directives (#define, #include, ...) are not accepted",
                ))
            }
            byte if is_word_byte(byte) || bytes[i..].starts_with(b"::") => {
                loop {
                    if i < bytes.len() && is_word_byte(bytes[i]) {
                        i += 1;
                    } else if bytes[i..].starts_with(b"::") {
                        i += 2;
                    } else {
                        break;
                    }
                }
                Kind::Word
            }
            byte if byte.is_ascii_graphic() => {
                i += 1;
                Kind::Punct
            }
            _ => return Err(malformed(line, "unexpected character outside comments and strings")),
        };
        tokens.push(Token {
            kind,
            text: &ptx[start..i],
            start,
            end: i,
            line,
        });
    }
    Ok(tokens)
}

/// How a statement ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    /// An instruction or a directive, ended by `;`.
    Semicolon,
    /// `{`: alone (a scope), or ending a function header (then the statement has tokens).
    Brace,
    /// `}`, alone.
    CloseBrace,
    /// `name:`.
    Label,
    /// A directive that ends at the end of its line (`.loc`, `.file`, ...).
    Line,
}

#[derive(Debug)]
struct Statement<'a> {
    /// The statement's tokens, without its terminator (`;`, `{`, `}`, `:`).
    tokens: Vec<Token<'a>>,
    end: End,
    /// Byte range in the source, terminator included.
    span: Range<usize>,
    line: usize,
    source: &'a str,
}

impl Statement<'_> {
    /// The statement's text for error messages.
    fn display(&self) -> String {
        self.source.split_whitespace().collect::<Vec<_>>().join(" ")
    }

    fn unsupported(&self, why: &'static str) -> FenceError {
        FenceError::Unsupported {
            line: self.line,
            instruction: self.display(),
            why,
        }
    }

    fn unfenced(&self) -> FenceError {
        FenceError::Unfenced {
            line: self.line,
            instruction: self.display(),
        }
    }

    fn is_directive(&self) -> bool {
        self.tokens
            .first()
            .is_some_and(|t| t.kind == Kind::Word && t.text.starts_with('.'))
    }
}

/// Directives that end at the end of their line rather than at a `;`.
const LINE_DIRECTIVES: [&str; 6] = [".version", ".target", ".address_size", ".file", ".loc", ".section"];

fn is_function_header(tokens: &[Token<'_>]) -> bool {
    tokens.iter().any(|t| t.is_word(".entry") || t.is_word(".func"))
}

fn split_statements<'a>(ptx: &'a str, tokens: &[Token<'a>]) -> Result<Vec<Statement<'a>>, FenceError> {
    let mut statements = Vec::new();
    let mut i = 0;
    while i < tokens.len() {
        let first = tokens[i];
        let (end, content, next) = if first.kind == Kind::Word && LINE_DIRECTIVES.contains(&first.text) {
            let stop = tokens[i..]
                .iter()
                .position(|t| t.line != first.line)
                .map_or(tokens.len(), |n| i + n);
            check_line_directive(&tokens[i..stop])?;
            (End::Line, i..stop, stop)
        } else if first.is("{") {
            (End::Brace, i..i, i + 1)
        } else if first.is("}") {
            (End::CloseBrace, i..i, i + 1)
        } else if first.kind == Kind::Word && tokens.get(i + 1).is_some_and(|t| t.is(":")) {
            (End::Label, i..i + 1, i + 2)
        } else {
            // Braces inside a statement are vector operands or initializers; a `{` at their depth 0
            // ends a function header.
            let mut depth = 0usize;
            let mut j = i;
            let end = loop {
                let Some(token) = tokens.get(j) else {
                    return Err(malformed(first.line, "statement not terminated by ';'"));
                };
                if token.kind == Kind::Word && LINE_DIRECTIVES.contains(&token.text) {
                    return Err(malformed(token.line, "directive inside a statement (missing ';'?)"));
                }
                if token.is(";") && depth == 0 {
                    break End::Semicolon;
                } else if token.is("{") {
                    if depth == 0 && is_function_header(&tokens[i..j]) {
                        break End::Brace;
                    }
                    depth += 1;
                } else if token.is("}") {
                    if depth == 0 {
                        return Err(malformed(token.line, "'}' inside a statement (missing ';'?)"));
                    }
                    depth -= 1;
                }
                j += 1;
            };
            (end, i..j, j + 1)
        };
        let span = first.start..tokens[next - 1].end;
        statements.push(Statement {
            tokens: tokens[content].to_vec(),
            end,
            source: &ptx[span.clone()],
            span,
            line: first.line,
        });
        i = next;
    }
    Ok(statements)
}

/// ptxas accepts anything after a line directive's arguments as the next statement, so the
/// arguments are checked to be exactly what the directive takes: nothing can hide behind one.
fn check_line_directive(tokens: &[Token<'_>]) -> Result<(), FenceError> {
    let directive = tokens[0];
    let args = &tokens[1..];
    let digits = |t: &Token<'_>| t.kind == Kind::Word && t.text.bytes().all(|b| b.is_ascii_digit());
    let ok = match directive.text {
        ".section" => {
            return Err(FenceError::Unsupported {
                line: directive.line,
                instruction: directive.text.to_string(),
                why: why::DEBUG_SECTION,
            })
        }
        ".version" => {
            args.len() == 1
                && args[0].kind == Kind::Word
                && args[0].text.bytes().all(|b| b.is_ascii_digit() || b == b'.')
        }
        ".address_size" => args.len() == 1 && digits(&args[0]),
        ".target" => args.iter().enumerate().all(|(n, t)| {
            if n % 2 == 1 {
                t.is(",")
            } else {
                t.kind == Kind::Word
                    && t.text
                        .bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
            }
        }),
        ".file" => {
            args.len() >= 2
                && digits(&args[0])
                && args[1].kind == Kind::Str
                && args[2..]
                    .iter()
                    .enumerate()
                    .all(|(n, t)| if n % 2 == 0 { t.is(",") } else { digits(t) })
        }
        // `.loc file line column [, function_name label[+offset], inlined_at file line column]`
        _ => args.iter().all(|t| {
            digits(t)
                || t.is(",")
                || t.is("+")
                || t.is_word("function_name")
                || t.is_word("inlined_at")
                || (t.kind == Kind::Word && t.text.starts_with('$'))
        }),
    };
    if ok {
        Ok(())
    } else {
        Err(malformed(directive.line, "unexpected arguments after a line directive"))
    }
}

/// A function with a body.
struct Function<'a> {
    is_entry: bool,
    name: &'a str,
    /// Index of the header statement (it ends with the body's `{`).
    header: usize,
    /// Statements inside the outer braces (nested scopes included).
    body: Range<usize>,
}

struct Module<'a> {
    statements: Vec<Statement<'a>>,
    functions: Vec<Function<'a>>,
}

/// The name of a function header and its index among the header's tokens.
fn function_name<'a>(header: &Statement<'a>) -> Result<(bool, &'a str, usize), FenceError> {
    let tokens = &header.tokens;
    let keyword = tokens
        .iter()
        .position(|t| t.is_word(".entry") || t.is_word(".func"))
        .ok_or(malformed(header.line, "no name"))?;
    let mut k = keyword + 1;
    if tokens.get(k).is_some_and(|t| t.is("(")) {
        k = matching_paren(tokens, k).ok_or(malformed(header.line, "unbalanced parentheses"))? + 1;
    }
    match tokens.get(k) {
        Some(name) if name.kind == Kind::Word => Ok((tokens[keyword].text == ".entry", name.text, k)),
        _ => Err(malformed(header.line, "function header without a name")),
    }
}

fn matching_paren(tokens: &[Token<'_>], open: usize) -> Option<usize> {
    let mut depth = 0usize;
    for (k, t) in tokens.iter().enumerate().skip(open) {
        if t.is("(") {
            depth += 1;
        } else if t.is(")") {
            depth -= 1;
            if depth == 0 {
                return Some(k);
            }
        }
    }
    None
}

/// Module-scope directives (after linkage keywords) that may appear outside functions.
const MODULE_DIRECTIVES: [&str; 10] = [
    ".version",
    ".target",
    ".address_size",
    ".file",
    ".global",
    ".const",
    ".shared",
    ".local",
    ".pragma",
    ".alias",
];
const LINKAGE: [&str; 4] = [".visible", ".extern", ".weak", ".common"];

fn parse_module(ptx: &str) -> Result<Module<'_>, FenceError> {
    let tokens = tokenize(ptx)?;
    let statements = split_statements(ptx, &tokens)?;
    let mut functions = Vec::new();
    let mut declarations = Vec::new();
    let mut address_size = None;
    let mut i = 0;
    while i < statements.len() {
        let statement = &statements[i];
        match statement.end {
            End::Brace if !statement.tokens.is_empty() => {
                let (is_entry, name, _) = function_name(statement)?;
                let mut depth = 1;
                let mut j = i + 1;
                loop {
                    let inner = statements
                        .get(j)
                        .ok_or(malformed(statement.line, "function body not closed"))?;
                    match inner.end {
                        End::Brace if !inner.tokens.is_empty() => {
                            return Err(malformed(inner.line, "function header inside a function body"))
                        }
                        End::Brace => depth += 1,
                        End::CloseBrace => {
                            depth -= 1;
                            if depth == 0 {
                                break;
                            }
                        }
                        _ => {}
                    }
                    j += 1;
                }
                functions.push(Function {
                    is_entry,
                    name,
                    header: i,
                    body: i + 1..j,
                });
                i = j + 1;
                continue;
            }
            End::Semicolon if is_function_header(&statement.tokens) => {
                declarations.push((function_name(statement)?.1, i));
            }
            End::Brace | End::CloseBrace | End::Label => {
                return Err(malformed(statement.line, "braces or labels outside a function"))
            }
            End::Semicolon | End::Line => {
                let keyword = statement.tokens.iter().find(|t| !LINKAGE.contains(&t.text));
                if !keyword.is_some_and(|k| MODULE_DIRECTIVES.contains(&k.text)) {
                    return Err(malformed(statement.line, "unexpected statement at module scope"));
                }
                if statement.tokens[0].is_word(".address_size") {
                    address_size = Some(i);
                }
            }
        }
        i += 1;
    }
    match address_size {
        Some(k) if statements[k].tokens[1].text == "64" => {}
        Some(k) => return Err(statements[k].unsupported(why::ADDRESS_SIZE)),
        None => {
            return Err(FenceError::Unsupported {
                line: 1,
                instruction: String::new(),
                why: why::ADDRESS_SIZE,
            })
        }
    }
    // A declared function must be defined here: calls may only reach code this pass has seen.
    for (name, k) in declarations {
        if !functions.iter().any(|f| f.name == name) {
            return Err(statements[k].unsupported(why::UNDEFINED_FUNCTION));
        }
    }
    Ok(Module { statements, functions })
}

/// An instruction split into guard, opcode and operands (split at top-level commas).
struct Instruction<'s, 'a> {
    guard: &'s [Token<'a>],
    opcode: &'a str,
    operands: Vec<&'s [Token<'a>]>,
}

fn split_instruction<'s, 'a>(statement: &'s Statement<'a>) -> Result<Instruction<'s, 'a>, FenceError> {
    let tokens = &statement.tokens;
    let line = statement.line;
    let mut k = 0;
    if tokens[0].is("@") {
        k = if tokens.get(1).is_some_and(|t| t.is("!")) { 2 } else { 1 };
        if !tokens
            .get(k)
            .is_some_and(|t| t.kind == Kind::Word && t.text.starts_with('%'))
        {
            return Err(malformed(line, "guard is not a predicate register"));
        }
        k += 1;
    }
    let opcode = match tokens.get(k) {
        Some(t) if t.kind == Kind::Word && t.text.starts_with(|c: char| c.is_ascii_lowercase()) => t.text,
        _ => return Err(malformed(line, "expected an instruction")),
    };
    let mut operands = Vec::new();
    let rest = &tokens[k + 1..];
    let (mut depth, mut from) = (0usize, 0);
    for (n, t) in rest.iter().enumerate() {
        // Operands never contain a word like `ld.global.f32` (identifiers have no dots; registers
        // and numbers do): one would mean two instructions in one statement.
        if t.kind == Kind::Word && t.text.contains('.') && !t.text.starts_with(|c: char| c == '%' || c.is_ascii_digit())
        {
            return Err(malformed(line, "an opcode or directive among operands (missing ';'?)"));
        }
        if t.is("[") || t.is("{") || t.is("(") {
            depth += 1;
        } else if t.is("]") || t.is("}") || t.is(")") {
            depth = depth.checked_sub(1).ok_or(malformed(line, "unbalanced brackets"))?;
        } else if t.is(",") && depth == 0 {
            operands.push(&rest[from..n]);
            from = n + 1;
        }
    }
    if depth != 0 {
        return Err(malformed(line, "unbalanced brackets"));
    }
    if from < rest.len() || !operands.is_empty() {
        operands.push(&rest[from..]);
    }
    Ok(Instruction {
        guard: &tokens[..k],
        opcode,
        operands,
    })
}

fn is_reserved(word: &str) -> bool {
    word.contains("%agora_") || word.contains("_agora_fence_")
}

/// Directives allowed inside a function body.
const BODY_DIRECTIVES: [&str; 8] = [
    ".reg",
    ".local",
    ".shared",
    ".param",
    ".pragma",
    ".callprototype",
    ".branchtargets",
    ".calltargets",
];

// ---------------------------------------------------------------------------------------------
// The rewrite.
// ---------------------------------------------------------------------------------------------

/// What the rewrite does with one instruction.
#[derive(Debug, PartialEq, Eq)]
enum Plan {
    /// Not a global access (no memory, or an explicit non-global state space).
    Leave,
    /// An explicit `.global` access: mask its address.
    Global,
    /// A generic access: mask its address if it is global.
    Generic,
    /// Reaches global memory in a way the pass does not fence.
    Refuse(&'static str),
}

/// State spaces that are not global (a qualifier naming one means the access is not global).
fn is_non_global_space(qualifier: &str) -> bool {
    matches!(qualifier, "shared" | "local" | "param" | "const")
        || qualifier.starts_with("shared::")
        || qualifier.starts_with("param::")
}

fn plan_access(opcode: &str, has_address: bool) -> Plan {
    let mut parts = opcode.split('.');
    let root = parts.next().unwrap_or_default();
    let qualifiers: Vec<&str> = parts.collect();
    let has = |q: &str| qualifiers.contains(&q);
    let non_global = qualifiers.iter().any(|q| is_non_global_space(q));
    match root {
        "ld" | "ldu" | "st" | "atom" | "red" => {
            if has("async") {
                Plan::Refuse(why::ASYNC_STORE)
            } else if has("bulk") && !non_global {
                Plan::Refuse(why::BULK)
            } else if has("global") {
                Plan::Global
            } else if non_global {
                Plan::Leave
            } else {
                Plan::Generic
            }
        }
        "cp" => Plan::Refuse(why::ASYNC_COPY),
        "prefetch" | "prefetchu" | "applypriority" | "discard" => Plan::Refuse(why::CACHE_CONTROL),
        "tex" | "tld4" | "txq" | "suld" | "sust" | "sured" | "suq" | "istypep" => Plan::Refuse(why::TEXTURE),
        "multimem" => Plan::Refuse(why::MULTIMEM),
        "tensormap" => Plan::Refuse(why::TENSORMAP),
        "mbarrier" | "ldmatrix" | "stmatrix" | "wmma" if has_address => {
            if non_global && !has("global") {
                Plan::Leave
            } else {
                Plan::Refuse(why::NOT_SHARED)
            }
        }
        _ if has_address => Plan::Refuse(why::UNKNOWN_ADDRESSING),
        _ => Plan::Leave,
    }
}

/// The base of an address operand.
enum Base<'a> {
    Register(&'a str),
    Variable(&'a str),
}

/// Parses `[base]`, `[base+imm]` or `[base+-imm]` into the base and the offset's text.
fn parse_address<'a>(operand: &[Token<'a>], line: usize) -> Result<(Base<'a>, Option<String>), FenceError> {
    let not_understood = || {
        malformed(
            line,
            "address operand not understood (expected [%reg], [%reg+imm] or [var+imm])",
        )
    };
    let inner = match operand {
        [open, inner @ .., close] if open.is("[") && close.is("]") => inner,
        _ => return Err(not_understood()),
    };
    let (base, offset) = inner.split_first().ok_or_else(not_understood)?;
    if base.kind != Kind::Word {
        return Err(not_understood());
    }
    let base = if base.text.starts_with('%') {
        Base::Register(base.text)
    } else if base
        .text
        .starts_with(|c: char| c.is_ascii_alphabetic() || c == '_' || c == '$')
    {
        Base::Variable(base.text)
    } else {
        return Err(malformed(line, "immediate address: PTX allows one only for .local"));
    };
    let is_integer = |t: &Token<'_>| {
        let text = t.text.strip_suffix('U').unwrap_or(t.text);
        t.kind == Kind::Word
            && (text.bytes().all(|b| b.is_ascii_digit())
                || text
                    .strip_prefix("0x")
                    .or(text.strip_prefix("0X"))
                    .is_some_and(|hex| !hex.is_empty() && hex.bytes().all(|b| b.is_ascii_hexdigit())))
    };
    let offset = match offset {
        [] => None,
        [plus, value] if plus.is("+") && is_integer(value) => Some(value.text.to_string()),
        [plus, minus, value] if plus.is("+") && minus.is("-") && is_integer(value) => Some(format!("-{}", value.text)),
        _ => return Err(not_understood()),
    };
    Ok((base, offset))
}

/// The instructions that leave the fenced address of `operand` in [`ADDR_REG`].
fn fence_sequence(plan: &Plan, base: Base<'_>, offset: Option<String>) -> Vec<String> {
    let mut sequence = Vec::new();
    // The raw effective address, unless the mask can be applied to the base register directly.
    let masked_source = match (&base, &offset, plan) {
        (Base::Register(register), None, Plan::Global) => register.to_string(),
        (Base::Register(register), None, _) => {
            sequence.push(format!("mov.b64 {ADDR_REG}, {register};"));
            ADDR_REG.to_string()
        }
        (Base::Register(register), Some(offset), _) => {
            sequence.push(format!("add.s64 {ADDR_REG}, {register}, {offset};"));
            ADDR_REG.to_string()
        }
        (Base::Variable(variable), offset, _) => {
            sequence.push(format!("mov.u64 {ADDR_REG}, {variable};"));
            if let Some(offset) = offset {
                sequence.push(format!("add.s64 {ADDR_REG}, {ADDR_REG}, {offset};"));
            }
            ADDR_REG.to_string()
        }
    };
    if *plan == Plan::Generic {
        // Predicated rather than a `selp`: same effect, one register fewer, and the masking
        // instructions sit right before the access in both forms.
        sequence.push(format!("isspacep.global {PRED_REG}, {ADDR_REG};"));
        sequence.push(format!("@{PRED_REG} and.b64 {ADDR_REG}, {ADDR_REG}, {MASK_REG};"));
        sequence.push(format!("@{PRED_REG} or.b64 {ADDR_REG}, {ADDR_REG}, {BASE_REG};"));
    } else {
        sequence.push(format!("and.b64 {ADDR_REG}, {masked_source}, {MASK_REG};"));
        sequence.push(format!("or.b64 {ADDR_REG}, {ADDR_REG}, {BASE_REG};"));
    }
    sequence
}

/// Rewrites `ptx` so that every global access of its kernels stays in the partition passed at
/// launch (see the module documentation). Each `.entry` gets two `.u64` parameters appended
/// (base, then mask: [`fence_arguments`]). Everything else is kept byte for byte.
pub fn fence(ptx: &str) -> Result<Fenced, FenceError> {
    let module = parse_module(ptx)?;
    for statement in &module.statements {
        if statement.tokens.iter().any(|t| is_reserved(t.text)) {
            return Err(statement.unsupported(why::RESERVED));
        }
    }
    refuse_recursion(&module)?;
    // (byte range replaced, replacement); insertions are empty ranges.
    let mut edits: Vec<(Range<usize>, String)> = Vec::new();
    let mut entries = Vec::new();
    let mut fenced_accesses = 0;
    for function in &module.functions {
        let labels = labels_of(&module.statements, function);
        for (at, statement) in module.statements[function.body.clone()]
            .iter()
            .enumerate()
            .map(|(k, st)| (function.body.start + k, st))
        {
            if statement.end != End::Semicolon {
                continue;
            }
            if statement.is_directive() {
                if !BODY_DIRECTIVES.contains(&statement.tokens[0].text) {
                    return Err(malformed(statement.line, "unexpected directive in a function body"));
                }
                continue;
            }
            let instruction = split_instruction(statement)?;
            if loops_back(&instruction, &labels, at) {
                if !function.is_entry {
                    return Err(statement.unsupported(why::FUNC_LOOP));
                }
                // The stop poll, right before the branch (unguarded: it runs every iteration).
                let indent = line_indent(ptx, statement.span.start);
                let poll: String = POLL.iter().map(|p| format!("{}\n{indent}", poll_text(p))).collect();
                edits.push((statement.span.start..statement.span.start, poll));
                continue;
            }
            let addresses: Vec<_> = instruction
                .operands
                .iter()
                .filter(|op| op.first().is_some_and(|t| t.is("[")))
                .collect();
            let plan = plan_access(instruction.opcode, !addresses.is_empty());
            match plan {
                Plan::Leave => continue,
                Plan::Refuse(why) => return Err(statement.unsupported(why)),
                Plan::Global | Plan::Generic if !function.is_entry => return Err(statement.unsupported(why::FUNC)),
                Plan::Global | Plan::Generic => {}
            }
            let [operand] = addresses[..] else {
                return Err(malformed(
                    statement.line,
                    "a memory access needs exactly one address operand",
                ));
            };
            let (base, offset) = parse_address(operand, statement.line)?;
            if plan == Plan::Generic && matches!(base, Base::Variable(_)) {
                return Err(statement.unsupported(why::GENERIC_VARIABLE));
            }
            let indent = line_indent(ptx, statement.span.start);
            let inserted: String = fence_sequence(&plan, base, offset)
                .iter()
                .map(|line| format!("{line}\n{indent}"))
                .collect();
            edits.push((statement.span.start..statement.span.start, inserted));
            edits.push((
                operand[0].start..operand[operand.len() - 1].end,
                format!("[{ADDR_REG}]"),
            ));
            fenced_accesses += 1;
        }
        if function.is_entry {
            let header = &module.statements[function.header];
            edits.push(append_fence_params(header, function.name)?);
            let prologue = format!(
                "\n\t.reg .b64 {BASE_REG}, {MASK_REG}, {ADDR_REG}, {STOP_REG};\
                 \n\t.reg .b32 {LAUNCH_REG}, {COUNT_REG}, {WORD_REG};\
                 \n\t.reg .pred {PRED_REG}, {POLL_PRED};\
                 \n\tld.param.u64 {BASE_REG}, [{name}{BASE_PARAM_SUFFIX}];\
                 \n\tld.param.u64 {MASK_REG}, [{name}{MASK_PARAM_SUFFIX}];\
                 \n\tld.param.u64 {STOP_REG}, [{name}{STOP_PARAM_SUFFIX}];\
                 \n\tld.param.u32 {LAUNCH_REG}, [{name}{LAUNCH_PARAM_SUFFIX}];\
                 \n\tmov.u32 {COUNT_REG}, 0;",
                name = function.name
            );
            edits.push((header.span.end..header.span.end, prologue));
            entries.push(function.name.to_string());
        }
    }
    edits.sort_by_key(|(range, _)| (range.start, range.end));
    let mut out = String::with_capacity(ptx.len() + edits.iter().map(|(_, text)| text.len()).sum::<usize>());
    let mut at = 0;
    for (range, text) in edits {
        out.push_str(&ptx[at..range.start]);
        out.push_str(&text);
        at = range.end;
    }
    out.push_str(&ptx[at..]);
    Ok(Fenced {
        ptx: out,
        entries,
        fenced_accesses,
    })
}

/// How many parameters the kernel `entry` (a `.entry`, defined or declared) of `ptx` takes, or
/// `None` when the module has no such entry. Reads the module's function headers only, so it
/// accepts trusted modules the pass would refuse (a `printf`, 32-bit addresses): it is how a
/// CUDA implementation's signature is checked against its kernel's declared parameters before
/// the module is loaded.
pub fn entry_parameter_count(ptx: &str, entry: &str) -> Result<Option<usize>, FenceError> {
    let tokens = tokenize(ptx)?;
    for statement in split_statements(ptx, &tokens)? {
        if !statement.tokens.iter().any(|t| t.is_word(".entry")) {
            continue;
        }
        let (true, name, at) = function_name(&statement)? else {
            continue;
        };
        if name != entry {
            continue;
        }
        let tokens = &statement.tokens;
        let open = at + 1;
        if !tokens.get(open).is_some_and(|t| t.is("(")) {
            return Ok(Some(0));
        }
        let close = matching_paren(tokens, open).ok_or(malformed(statement.line, "unbalanced parentheses"))?;
        return Ok(Some(tokens[open..close].iter().filter(|t| t.is_word(".param")).count()));
    }
    Ok(None)
}

/// The whitespace that starts the line `at` is on, if only whitespace precedes `at` (else a tab).
fn line_indent(ptx: &str, at: usize) -> &str {
    let line_start = ptx[..at].rfind('\n').map_or(0, |n| n + 1);
    let before = &ptx[line_start..at];
    if before.bytes().all(|b| b == b' ' || b == b'\t') {
        before
    } else {
        "\t"
    }
}

/// The four fence parameters of kernel `name`, as [`append_fence_params`] writes them and
/// [`check_fenced`] expects them (tokens joined by spaces).
fn fence_params(name: &str) -> [String; 4] {
    [
        format!(".param .u64 {name}{BASE_PARAM_SUFFIX}"),
        format!(".param .u64 {name}{MASK_PARAM_SUFFIX}"),
        format!(".param .u64 {name}{STOP_PARAM_SUFFIX}"),
        format!(".param .u32 {name}{LAUNCH_PARAM_SUFFIX}"),
    ]
}

/// The text of one statement of [`POLL`].
fn poll_text((guard, opcode, operands): &(&str, &str, &[&str])) -> String {
    let head = if guard.is_empty() {
        opcode.to_string()
    } else {
        format!("{guard} {opcode}")
    };
    if operands.is_empty() {
        format!("{head};")
    } else {
        format!("{head} {};", operands.join(", "))
    }
}

/// The labels of `function`'s body, with the index of the statement that defines each.
fn labels_of<'a>(statements: &[Statement<'a>], function: &Function<'a>) -> std::collections::HashMap<&'a str, usize> {
    function
        .body
        .clone()
        .filter(|&k| statements[k].end == End::Label)
        .filter_map(|k| statements[k].tokens.first().map(|t| (t.text, k)))
        .collect()
}

/// Whether `instruction` (the statement at index `at`) may jump backwards: a branch to a label
/// defined at or before it, or an indirect branch (whose targets are not checked).
fn loops_back(instruction: &Instruction<'_, '_>, labels: &std::collections::HashMap<&str, usize>, at: usize) -> bool {
    match instruction.opcode.split('.').next().unwrap_or_default() {
        "bra" => {
            let target: String = instruction
                .operands
                .last()
                .map(|op| op.iter().map(|t| t.text).collect())
                .unwrap_or_default();
            // A target that is no label of the body is left to ptxas, which refuses it.
            labels.get(target.as_str()).is_some_and(|&k| k <= at)
        }
        "brx" => true,
        _ => false,
    }
}

/// The function a `call` instruction calls: its first operand that is a name, not a
/// parenthesised parameter list.
fn callee<'a>(instruction: &Instruction<'_, 'a>) -> Option<&'a str> {
    if instruction.opcode.split('.').next() != Some("call") {
        return None;
    }
    instruction.operands.iter().find_map(|op| match op {
        [name] if name.kind == Kind::Word => Some(name.text),
        _ => None,
    })
}

/// Refuses a module whose functions call each other in a cycle (recursion: a loop no branch
/// shows, so the stop poll would never run in it).
fn refuse_recursion(module: &Module<'_>) -> Result<(), FenceError> {
    let index: std::collections::HashMap<&str, usize> =
        module.functions.iter().enumerate().map(|(i, f)| (f.name, i)).collect();
    // Per function: the functions it calls, with the calling statement.
    let mut calls: Vec<Vec<(usize, usize)>> = vec![Vec::new(); module.functions.len()];
    for (i, function) in module.functions.iter().enumerate() {
        for k in function.body.clone() {
            let statement = &module.statements[k];
            if statement.end != End::Semicolon || statement.is_directive() {
                continue;
            }
            if let Some(target) = split_instruction(statement).ok().as_ref().and_then(callee) {
                if target.starts_with('%') {
                    // A call through a function pointer: its callee, and so a cycle, is unknown.
                    return Err(statement.unsupported(why::INDIRECT_CALL));
                }
                if let Some(&j) = index.get(target) {
                    calls[i].push((j, k));
                }
            }
        }
    }
    // Depth-first search for a back edge: 0 unvisited, 1 on the path, 2 done.
    fn visit(i: usize, calls: &[Vec<(usize, usize)>], state: &mut [u8]) -> Option<usize> {
        state[i] = 1;
        for &(j, at) in &calls[i] {
            match state[j] {
                1 => return Some(at),
                0 => {
                    if let Some(at) = visit(j, calls, state) {
                        return Some(at);
                    }
                }
                _ => {}
            }
        }
        state[i] = 2;
        None
    }
    let mut state = vec![0u8; module.functions.len()];
    for i in 0..module.functions.len() {
        if state[i] == 0 {
            if let Some(at) = visit(i, &calls, &mut state) {
                return Err(module.statements[at].unsupported(why::RECURSION));
            }
        }
    }
    Ok(())
}

/// The edit that appends the four fence parameters to an entry's parameter list.
fn append_fence_params(header: &Statement<'_>, name: &str) -> Result<(Range<usize>, String), FenceError> {
    let params = fence_params(name).map(|p| format!("\t{p}")).join(",\n");
    let (_, _, name_index) = function_name(header)?;
    let tokens = &header.tokens;
    let after_name = name_index + 1;
    if !tokens.get(after_name).is_some_and(|t| t.is("(")) {
        let at = tokens[name_index].end;
        return Ok((at..at, format!("(\n{params}\n)")));
    }
    let close = matching_paren(tokens, after_name).ok_or(malformed(header.line, "unbalanced parentheses"))?;
    Ok(if close == after_name + 1 {
        let at = tokens[after_name].end;
        (at..at, format!("\n{params}\n"))
    } else {
        let at = tokens[close - 1].end;
        (at..at, format!(",\n{params}"))
    })
}

// ---------------------------------------------------------------------------------------------
// The check. It re-parses the text and decides on its own which instructions must be fenced: any
// instruction with an address operand must either name a non-global state space (and be one of
// the few that may), or use exactly `[%agora_fa]` right after the masking instructions.
// ---------------------------------------------------------------------------------------------

/// A statement as comparable text: guard, opcode, operands (tokens concatenated).
fn normalized(statement: &Statement<'_>) -> Option<(String, String, Vec<String>)> {
    if statement.end != End::Semicolon || statement.is_directive() {
        return None;
    }
    let instruction = split_instruction(statement).ok()?;
    let join = |tokens: &[Token<'_>]| tokens.iter().map(|t| t.text).collect::<String>();
    Some((
        join(instruction.guard),
        instruction.opcode.to_string(),
        instruction.operands.iter().map(|op| join(op)).collect(),
    ))
}

fn statement_is(statement: Option<&Statement<'_>>, guard: &str, opcode: &str, operands: &[&str]) -> bool {
    statement
        .and_then(normalized)
        .is_some_and(|(g, o, ops)| g == guard && o == opcode && ops == operands)
}

/// The `and` that masks: its source may be anything, since whatever it is gets masked.
fn is_mask_and(statement: Option<&Statement<'_>>, guard: &str) -> bool {
    statement.and_then(normalized).is_some_and(|(g, o, ops)| {
        g == guard && o == "and.b64" && ops.len() == 3 && ops[0] == ADDR_REG && ops[2] == MASK_REG
    })
}

/// Checks that every global access in `ptx` is fenced (see the module documentation) and that no
/// instruction reaches global memory otherwise; returns how many accesses it checked. Independent
/// of [`fence`]'s decisions: run it on PTX before loading it as fenced.
pub fn check_fenced(ptx: &str) -> Result<usize, FenceError> {
    let module = parse_module(ptx)?;
    refuse_recursion(&module)?;
    let mut in_function = vec![false; module.statements.len()];
    let mut checked = 0;
    for function in &module.functions {
        in_function[function.header] = true;
        in_function[function.body.clone()].iter_mut().for_each(|x| *x = true);
        let header = &module.statements[function.header];
        let body = &module.statements[function.body.clone()];
        let prologue = if function.is_entry {
            verify_entry_start(header, body, function.name)?;
            PROLOGUE
        } else {
            if header.tokens.iter().any(|t| is_reserved(t.text)) {
                return Err(header.unsupported(why::RESERVED));
            }
            0
        };
        for k in prologue..body.len() {
            checked += verify_statement(body, k, prologue, function.is_entry)?;
        }
        // Every loop of a kernel passes the stop poll (a device function may not loop).
        let labels = labels_of(&module.statements, function);
        for (k, statement) in body.iter().enumerate() {
            let Some(instruction) = (statement.end == End::Semicolon && !statement.is_directive())
                .then(|| split_instruction(statement))
                .transpose()?
            else {
                continue;
            };
            if !loops_back(&instruction, &labels, function.body.start + k) {
                continue;
            }
            if !function.is_entry {
                return Err(statement.unsupported(why::FUNC_LOOP));
            }
            let polled = k >= prologue + POLL.len()
                && POLL.iter().enumerate().all(|(n, (guard, opcode, operands))| {
                    statement_is(Some(&body[k - POLL.len() + n]), guard, opcode, operands)
                });
            if !polled {
                return Err(statement.unfenced());
            }
        }
    }
    for (statement, _) in module
        .statements
        .iter()
        .zip(&in_function)
        .filter(|(_, inside)| !**inside)
    {
        if statement.tokens.iter().any(|t| is_reserved(t.text)) {
            return Err(statement.unsupported(why::RESERVED));
        }
    }
    Ok(checked)
}

/// Statements of the prologue the rewrite puts at the start of each kernel's body.
const PROLOGUE: usize = 8;

/// An entry's last four parameters are the fence's, and its body starts by loading them.
fn verify_entry_start(header: &Statement<'_>, body: &[Statement<'_>], name: &str) -> Result<(), FenceError> {
    let base_param = format!("{name}{BASE_PARAM_SUFFIX}");
    let mask_param = format!("{name}{MASK_PARAM_SUFFIX}");
    let stop_param = format!("{name}{STOP_PARAM_SUFFIX}");
    let launch_param = format!("{name}{LAUNCH_PARAM_SUFFIX}");
    let tokens = &header.tokens;
    // The parameter list is the parenthesized group right after the name.
    let (_, _, name_at) = function_name(header)?;
    if !tokens.get(name_at + 1).is_some_and(|t| t.is("(")) {
        return Err(header.unfenced());
    }
    let close = matching_paren(tokens, name_at + 1).ok_or_else(|| header.unfenced())?;
    let params: Vec<String> = tokens[name_at + 2..close]
        .split(|t| t.is(","))
        .map(|param| param.iter().map(|t| t.text).collect::<Vec<_>>().join(" "))
        .collect();
    let expected = fence_params(name);
    if params.len() < expected.len() || params[params.len() - expected.len()..] != expected {
        return Err(header.unfenced());
    }
    if params[..params.len() - expected.len()].iter().any(|p| is_reserved(p))
        || tokens[close + 1..].iter().any(|t| is_reserved(t.text))
    {
        return Err(header.unsupported(why::RESERVED));
    }
    let start_line = header.line;
    let decl = |k: usize, words: &[&str]| {
        body.get(k).is_some_and(|s| {
            s.end == End::Semicolon
                && s.tokens
                    .iter()
                    .map(|t| t.text)
                    .filter(|t| *t != ",")
                    .eq(words.iter().copied())
        })
    };
    let ok = decl(0, &[".reg", ".b64", BASE_REG, MASK_REG, ADDR_REG, STOP_REG])
        && decl(1, &[".reg", ".b32", LAUNCH_REG, COUNT_REG, WORD_REG])
        && decl(2, &[".reg", ".pred", PRED_REG, POLL_PRED])
        && statement_is(body.get(3), "", "ld.param.u64", &[BASE_REG, &format!("[{base_param}]")])
        && statement_is(body.get(4), "", "ld.param.u64", &[MASK_REG, &format!("[{mask_param}]")])
        && statement_is(body.get(5), "", "ld.param.u64", &[STOP_REG, &format!("[{stop_param}]")])
        && statement_is(
            body.get(6),
            "",
            "ld.param.u32",
            &[LAUNCH_REG, &format!("[{launch_param}]")],
        )
        && statement_is(body.get(7), "", "mov.u32", &[COUNT_REG, "0"]);
    if !ok {
        let at = body.first().unwrap_or(header);
        return Err(FenceError::Unfenced {
            line: at.line.max(start_line),
            instruction: at.display(),
        });
    }
    Ok(())
}

/// Checks the `k`th statement of a function body; returns 1 for a checked fenced access.
fn verify_statement(body: &[Statement<'_>], k: usize, prologue: usize, is_entry: bool) -> Result<usize, FenceError> {
    let statement = &body[k];
    let reserved = statement.tokens.iter().any(|t| is_reserved(t.text));
    if statement.end != End::Semicolon || statement.is_directive() {
        // Nothing outside the prologue may declare (or shadow, in a nested scope) a fence name.
        if reserved {
            return Err(statement.unsupported(why::RESERVED));
        }
        if statement.end == End::Semicolon && !BODY_DIRECTIVES.contains(&statement.tokens[0].text) {
            return Err(malformed(statement.line, "unexpected directive in a function body"));
        }
        return Ok(0);
    }
    let instruction = split_instruction(statement)?;
    if reserved {
        if !is_entry {
            return Err(statement.unsupported(why::RESERVED));
        }
        // The stop poll's registers appear in its statements only, exactly as written (so the
        // stop word's address is the prologue's, and its one global load reads only that word).
        let poll_registers = [STOP_REG, LAUNCH_REG, COUNT_REG, WORD_REG, POLL_PRED];
        if statement.tokens.iter().any(|t| poll_registers.contains(&t.text)) {
            let is_poll = POLL
                .iter()
                .any(|(guard, opcode, operands)| statement_is(Some(statement), guard, opcode, operands));
            return if is_poll { Ok(0) } else { Err(statement.unfenced()) };
        }
        // The base and mask registers are read by the masking instructions only (so nothing else
        // can write them); other fence names may only be the two scratch registers.
        let uses_base_or_mask = statement
            .tokens
            .iter()
            .any(|t| t.text == BASE_REG || t.text == MASK_REG);
        let masking = ["", &format!("@{PRED_REG}")].iter().any(|guard| {
            is_mask_and(Some(statement), guard)
                || statement_is(Some(statement), guard, "or.b64", &[ADDR_REG, ADDR_REG, BASE_REG])
        });
        let foreign = statement
            .tokens
            .iter()
            .any(|t| is_reserved(t.text) && ![ADDR_REG, PRED_REG, BASE_REG, MASK_REG].contains(&t.text));
        if foreign || (uses_base_or_mask && !masking) {
            return Err(statement.unfenced());
        }
    }
    let brackets = statement.tokens.iter().filter(|t| t.is("[")).count();
    if brackets == 0 {
        return Ok(0);
    }
    let mut parts = instruction.opcode.split('.');
    let root = parts.next().unwrap_or_default();
    let qualifiers: Vec<&str> = parts.collect();
    let global = qualifiers.contains(&"global");
    let other_space = qualifiers.iter().any(|q| is_non_global_space(q));
    let generic = match root {
        "ld" | "ldu" | "st" | "atom" | "red" if !qualifiers.contains(&"async") => {
            if qualifiers.contains(&"bulk") && (global || !other_space) {
                return Err(statement.unsupported(why::BULK));
            } else if global {
                false
            } else if other_space {
                return Ok(0);
            } else {
                true
            }
        }
        "mbarrier" | "ldmatrix" | "stmatrix" | "wmma" if other_space && !global => return Ok(0),
        _ => return Err(statement.unsupported(why::UNKNOWN_ADDRESSING)),
    };
    if !is_entry {
        return Err(statement.unsupported(why::FUNC));
    }
    let address_operand = instruction
        .operands
        .iter()
        .find(|op| op.first().is_some_and(|t| t.is("[")));
    let address: Option<String> = address_operand.map(|op| op.iter().map(|t| t.text).collect());
    if brackets != 1 || address.as_deref() != Some(&format!("[{ADDR_REG}]")) {
        return Err(statement.unfenced());
    }
    // The masking instructions must be the statements right before (no label in between, so no
    // branch can skip them), and after the prologue.
    let before = |n: usize| (k >= prologue + n).then(|| &body[k - n]);
    let fenced = if generic {
        let guard = format!("@{PRED_REG}");
        statement_is(before(3), "", "isspacep.global", &[PRED_REG, ADDR_REG])
            && statement_is(before(2), &guard, "and.b64", &[ADDR_REG, ADDR_REG, MASK_REG])
            && statement_is(before(1), &guard, "or.b64", &[ADDR_REG, ADDR_REG, BASE_REG])
    } else {
        is_mask_and(before(2), "") && statement_is(before(1), "", "or.b64", &[ADDR_REG, ADDR_REG, BASE_REG])
    };
    if !fenced {
        return Err(statement.unfenced());
    }
    Ok(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;
    use std::process::Command;

    // Real NVRTC 12.9 output (`--gpu-architecture=compute_80`, banner comments dropped), from:
    // SAXPY: `y[i] = a*x[i] + y[i]; y[i+1] = x[i-1];` (offsets +4 and +-4)
    // VEC4: `__ldg(&x[i])` on float4 (inline ld.global.nc.v4), `x[i+2]`, a float4 store
    // ATOMICS: atomicAdd on float and unsigned; ATOMIC_KINDS: atomicAdd/Max/CAS/Exch
    // GENERIC: a pointer that is global, shared or local by a runtime choice (ld.f32 generic)
    // REDUCE_SHARED: a shared-memory tree reduction with barriers
    // OUT_OF_BOUNDS: `out[i + (1<<28)] = 1.0f`
    // TWO_ENTRIES: two kernels in one module; GLOBAL_VARIABLES: `__device__` variables
    // FUNC_WITH_STORE: a `__noinline__` device function storing through its argument
    // PRINTF: printf (an extern vprintf); LINEINFO: compiled with -lineinfo (.loc, .file)
    const SAXPY: &str = r#".version 8.8
.target sm_80
.address_size 64

	// .globl	saxpy

.visible .entry saxpy(
	.param .f32 saxpy_param_0,
	.param .u64 saxpy_param_1,
	.param .u64 saxpy_param_2,
	.param .u32 saxpy_param_3
)
{
	.reg .pred 	%p<2>;
	.reg .f32 	%f<6>;
	.reg .b32 	%r<6>;
	.reg .b64 	%rd<8>;


	ld.param.f32 	%f1, [saxpy_param_0];
	ld.param.u64 	%rd1, [saxpy_param_1];
	ld.param.u64 	%rd2, [saxpy_param_2];
	ld.param.u32 	%r2, [saxpy_param_3];
	mov.u32 	%r3, %ntid.x;
	mov.u32 	%r4, %ctaid.x;
	mov.u32 	%r5, %tid.x;
	mad.lo.s32 	%r1, %r4, %r3, %r5;
	setp.ge.s32 	%p1, %r1, %r2;
	@%p1 bra 	$L__BB0_2;

	cvta.to.global.u64 	%rd3, %rd1;
	mul.wide.s32 	%rd4, %r1, 4;
	add.s64 	%rd5, %rd3, %rd4;
	ld.global.f32 	%f2, [%rd5];
	cvta.to.global.u64 	%rd6, %rd2;
	add.s64 	%rd7, %rd6, %rd4;
	ld.global.f32 	%f3, [%rd7];
	fma.rn.f32 	%f4, %f2, %f1, %f3;
	st.global.f32 	[%rd7], %f4;
	ld.global.f32 	%f5, [%rd5+-4];
	st.global.f32 	[%rd7+4], %f5;

$L__BB0_2:
	ret;

}

"#;

    const VEC4: &str = r#".version 8.8
.target sm_80
.address_size 64

	// .globl	vec4

.visible .entry vec4(
	.param .u64 vec4_param_0,
	.param .u64 vec4_param_1,
	.param .u32 vec4_param_2
)
{
	.reg .pred 	%p<2>;
	.reg .f32 	%f<7>;
	.reg .b32 	%r<7>;
	.reg .b64 	%rd<10>;


	ld.param.u64 	%rd1, [vec4_param_0];
	ld.param.u64 	%rd2, [vec4_param_1];
	ld.param.u32 	%r2, [vec4_param_2];
	mov.u32 	%r3, %ctaid.x;
	mov.u32 	%r4, %ntid.x;
	mov.u32 	%r5, %tid.x;
	mad.lo.s32 	%r1, %r3, %r4, %r5;
	setp.ge.s32 	%p1, %r1, %r2;
	@%p1 bra 	$L__BB0_2;

	cvta.to.global.u64 	%rd4, %rd1;
	mul.wide.s32 	%rd5, %r1, 16;
	add.s64 	%rd3, %rd1, %rd5;
	add.s32 	%r6, %r1, 2;
	mul.wide.s32 	%rd6, %r6, 16;
	add.s64 	%rd7, %rd4, %rd6;
	cvta.to.global.u64 	%rd8, %rd2;
	add.s64 	%rd9, %rd8, %rd5;
	// begin inline asm
	ld.global.nc.v4.f32 {%f1,%f2,%f3,%f4}, [%rd3];
	// end inline asm
	ld.global.f32 	%f5, [%rd7+4];
	add.f32 	%f6, %f1, %f5;
	st.global.v4.f32 	[%rd9], {%f6, %f2, %f3, %f4};

$L__BB0_2:
	ret;

}

"#;

    const ATOMICS: &str = r#".version 8.8
.target sm_80
.address_size 64

	// .globl	atomics

.visible .entry atomics(
	.param .u64 atomics_param_0,
	.param .u64 atomics_param_1,
	.param .u64 atomics_param_2,
	.param .u32 atomics_param_3
)
{
	.reg .pred 	%p<4>;
	.reg .f32 	%f<5>;
	.reg .b32 	%r<7>;
	.reg .b64 	%rd<10>;


	ld.param.u64 	%rd4, [atomics_param_0];
	ld.param.u64 	%rd3, [atomics_param_1];
	ld.param.u64 	%rd5, [atomics_param_2];
	ld.param.u32 	%r2, [atomics_param_3];
	cvta.to.global.u64 	%rd1, %rd4;
	cvta.to.global.u64 	%rd2, %rd5;
	mov.u32 	%r3, %ntid.x;
	mov.u32 	%r4, %ctaid.x;
	mov.u32 	%r5, %tid.x;
	mad.lo.s32 	%r1, %r4, %r3, %r5;
	setp.ge.s32 	%p1, %r1, %r2;
	@%p1 bra 	$L__BB0_4;

	cvta.to.global.u64 	%rd6, %rd3;
	mul.wide.s32 	%rd7, %r1, 4;
	add.s64 	%rd8, %rd2, %rd7;
	ld.global.f32 	%f2, [%rd8];
	atom.global.add.f32 	%f1, [%rd1], %f2;
	atom.global.add.u32 	%r6, [%rd6], 1;
	setp.leu.f32 	%p2, %f1, 0f3F800000;
	@%p2 bra 	$L__BB0_4;

	ld.global.f32 	%f3, [%rd2];
	setp.eq.f32 	%p3, %f3, 0f00000000;
	@%p3 bra 	$L__BB0_4;

	add.s64 	%rd9, %rd1, 4;
	atom.global.add.f32 	%f4, [%rd9], %f1;

$L__BB0_4:
	ret;

}

"#;

    const ATOMIC_KINDS: &str = r#".version 8.8
.target sm_80
.address_size 64

	// .globl	redk

.visible .entry redk(
	.param .u64 redk_param_0,
	.param .u64 redk_param_1
)
{
	.reg .b32 	%r<6>;
	.reg .b64 	%rd<8>;


	ld.param.u64 	%rd1, [redk_param_0];
	ld.param.u64 	%rd2, [redk_param_1];
	cvta.to.global.u64 	%rd3, %rd2;
	cvta.to.global.u64 	%rd4, %rd1;
	mov.u32 	%r1, 1;
	atom.global.add.u32 	%r2, [%rd4], 1;
	atom.global.max.u64 	%rd5, [%rd3], 5;
	add.s64 	%rd6, %rd4, 4;
	mov.u32 	%r3, 0;
	atom.global.cas.b32 	%r4, [%rd6], %r3, %r1;
	add.s64 	%rd7, %rd4, 8;
	atom.global.exch.b32 	%r5, [%rd7], 7;
	ret;

}

"#;

    const GENERIC: &str = r#".version 8.8
.target sm_80
.address_size 64

	// .globl	generic
// _ZZ7genericE4tile has been demoted

.visible .entry generic(
	.param .u64 generic_param_0,
	.param .u64 generic_param_1,
	.param .u32 generic_param_2
)
{
	.local .align 16 .b8 	__local_depot0[32];
	.reg .b64 	%SP;
	.reg .b64 	%SPL;
	.reg .pred 	%p<3>;
	.reg .f32 	%f<11>;
	.reg .b32 	%r<3>;
	.reg .b64 	%rd<23>;
	// demoted variable
	.shared .align 4 .b8 _ZZ7genericE4tile[256];

	mov.u64 	%SPL, __local_depot0;
	cvta.local.u64 	%SP, %SPL;
	ld.param.u64 	%rd5, [generic_param_0];
	ld.param.u64 	%rd22, [generic_param_1];
	ld.param.u32 	%r1, [generic_param_2];
	cvta.to.global.u64 	%rd8, %rd22;
	add.u64 	%rd9, %SP, 0;
	add.u64 	%rd10, %SPL, 0;
	ld.global.f32 	%f1, [%rd8+12];
	ld.global.f32 	%f2, [%rd8+8];
	ld.global.f32 	%f3, [%rd8+4];
	ld.global.f32 	%f4, [%rd8];
	st.local.v4.f32 	[%rd10], {%f4, %f3, %f2, %f1};
	ld.global.f32 	%f5, [%rd8+28];
	ld.global.f32 	%f6, [%rd8+24];
	ld.global.f32 	%f7, [%rd8+20];
	ld.global.f32 	%f8, [%rd8+16];
	st.local.v4.f32 	[%rd10+16], {%f8, %f7, %f6, %f5};
	mov.u32 	%r2, %tid.x;
	cvt.u64.u32 	%rd1, %r2;
	mul.wide.u32 	%rd11, %r2, 4;
	add.s64 	%rd12, %rd8, %rd11;
	ld.global.f32 	%f9, [%rd12];
	and.b64  	%rd13, %rd11, 252;
	mov.u64 	%rd14, _ZZ7genericE4tile;
	add.s64 	%rd15, %rd14, %rd13;
	st.shared.f32 	[%rd15], %f9;
	bar.sync 	0;
	cvta.shared.u64 	%rd21, %rd14;
	setp.eq.s32 	%p1, %r1, 0;
	@%p1 bra 	$L__BB0_4;

	setp.eq.s32 	%p2, %r1, 1;
	@%p2 bra 	$L__BB0_3;

	mov.u64 	%rd21, %rd9;

$L__BB0_3:
	mov.u64 	%rd22, %rd21;

$L__BB0_4:
	shl.b64 	%rd16, %rd1, 2;
	and.b64  	%rd17, %rd16, 28;
	add.s64 	%rd18, %rd22, %rd17;
	ld.f32 	%f10, [%rd18];
	cvta.to.global.u64 	%rd19, %rd5;
	add.s64 	%rd20, %rd19, %rd16;
	st.global.f32 	[%rd20], %f10;
	ret;

}

"#;

    const REDUCE_SHARED: &str = r#".version 8.8
.target sm_80
.address_size 64

	// .globl	reduce
// _ZZ6reduceE1s has been demoted

.visible .entry reduce(
	.param .u64 reduce_param_0,
	.param .u64 reduce_param_1
)
{
	.reg .pred 	%p<4>;
	.reg .f32 	%f<6>;
	.reg .b32 	%r<10>;
	.reg .b64 	%rd<15>;
	// demoted variable
	.shared .align 4 .b8 _ZZ6reduceE1s[1024];

	ld.param.u64 	%rd3, [reduce_param_0];
	ld.param.u64 	%rd2, [reduce_param_1];
	cvta.to.global.u64 	%rd4, %rd3;
	mov.u32 	%r1, %ctaid.x;
	shl.b32 	%r6, %r1, 8;
	mov.u32 	%r2, %tid.x;
	add.s32 	%r7, %r6, %r2;
	mul.wide.u32 	%rd5, %r7, 4;
	add.s64 	%rd6, %rd4, %rd5;
	ld.global.f32 	%f1, [%rd6];
	mul.wide.u32 	%rd7, %r2, 4;
	mov.u64 	%rd8, _ZZ6reduceE1s;
	add.s64 	%rd1, %rd8, %rd7;
	st.shared.f32 	[%rd1], %f1;
	bar.sync 	0;
	mov.u32 	%r9, 128;

$L__BB0_1:
	.pragma "nounroll";
	setp.ge.u32 	%p1, %r2, %r9;
	@%p1 bra 	$L__BB0_3;

	add.s32 	%r8, %r9, %r2;
	mul.wide.u32 	%rd9, %r8, 4;
	add.s64 	%rd11, %rd8, %rd9;
	ld.shared.f32 	%f2, [%rd1];
	ld.shared.f32 	%f3, [%rd11];
	add.f32 	%f4, %f3, %f2;
	st.shared.f32 	[%rd1], %f4;

$L__BB0_3:
	bar.sync 	0;
	shr.u32 	%r9, %r9, 1;
	setp.ne.s32 	%p2, %r9, 0;
	@%p2 bra 	$L__BB0_1;

	setp.ne.s32 	%p3, %r2, 0;
	@%p3 bra 	$L__BB0_6;

	cvta.to.global.u64 	%rd12, %rd2;
	ld.shared.f32 	%f5, [_ZZ6reduceE1s];
	mul.wide.u32 	%rd13, %r1, 4;
	add.s64 	%rd14, %rd12, %rd13;
	st.global.f32 	[%rd14], %f5;

$L__BB0_6:
	ret;

}

"#;

    const OUT_OF_BOUNDS: &str = r#".version 8.8
.target sm_80
.address_size 64

	// .globl	oob

.visible .entry oob(
	.param .u64 oob_param_0
)
{
	.reg .b32 	%r<4>;
	.reg .b64 	%rd<5>;


	ld.param.u64 	%rd1, [oob_param_0];
	cvta.to.global.u64 	%rd2, %rd1;
	mov.u32 	%r1, %tid.x;
	add.s32 	%r2, %r1, 268435456;
	mul.wide.s32 	%rd3, %r2, 4;
	add.s64 	%rd4, %rd2, %rd3;
	mov.u32 	%r3, 1065353216;
	st.global.u32 	[%rd4], %r3;
	ret;

}

"#;

    const TWO_ENTRIES: &str = r#".version 8.8
.target sm_80
.address_size 64

	// .globl	first

.visible .entry first(
	.param .u64 first_param_0
)
{
	.reg .b32 	%r<3>;
	.reg .b64 	%rd<5>;


	ld.param.u64 	%rd1, [first_param_0];
	cvta.to.global.u64 	%rd2, %rd1;
	mov.u32 	%r1, %tid.x;
	mul.wide.u32 	%rd3, %r1, 4;
	add.s64 	%rd4, %rd2, %rd3;
	mov.u32 	%r2, 1065353216;
	st.global.u32 	[%rd4], %r2;
	ret;

}
	// .globl	second
.visible .entry second(
	.param .u64 second_param_0,
	.param .u64 second_param_1
)
{
	.reg .b32 	%r<2>;
	.reg .f64 	%fd<3>;
	.reg .b64 	%rd<8>;


	ld.param.u64 	%rd1, [second_param_0];
	ld.param.u64 	%rd2, [second_param_1];
	cvta.to.global.u64 	%rd3, %rd1;
	cvta.to.global.u64 	%rd4, %rd2;
	mov.u32 	%r1, %tid.x;
	mul.wide.u32 	%rd5, %r1, 8;
	add.s64 	%rd6, %rd4, %rd5;
	ld.global.f64 	%fd1, [%rd6];
	add.f64 	%fd2, %fd1, %fd1;
	add.s64 	%rd7, %rd3, %rd5;
	st.global.f64 	[%rd7], %fd2;
	ret;

}

"#;

    const GLOBAL_VARIABLES: &str = r#".version 8.8
.target sm_80
.address_size 64

	// .globl	gv
.global .align 4 .u32 counter;
.global .align 4 .b8 table[64];

.visible .entry gv(
	.param .u64 gv_param_0
)
{
	.reg .f32 	%f<4>;
	.reg .b32 	%r<4>;
	.reg .b64 	%rd<10>;


	ld.param.u64 	%rd1, [gv_param_0];
	cvta.to.global.u64 	%rd2, %rd1;
	mov.u64 	%rd3, counter;
	atom.global.add.u32 	%r1, [%rd3], 1;
	ld.global.f32 	%f1, [table+12];
	mov.u64 	%rd4, table;
	mov.u32 	%r2, %tid.x;
	shl.b32 	%r3, %r2, 2;
	cvt.u64.u32 	%rd5, %r3;
	and.b64  	%rd6, %rd5, 60;
	add.s64 	%rd7, %rd4, %rd6;
	ld.global.f32 	%f2, [%rd7];
	add.f32 	%f3, %f1, %f2;
	mul.wide.u32 	%rd8, %r2, 4;
	add.s64 	%rd9, %rd2, %rd8;
	st.global.f32 	[%rd9], %f3;
	ret;

}

"#;

    const FUNC_WITH_STORE: &str = r#".version 8.8
.target sm_80
.address_size 64


.func _Z3putPff(
	.param .b64 _Z3putPff_param_0
)
{
	.reg .b32 	%r<2>;
	.reg .b64 	%rd<3>;


	ld.param.u64 	%rd1, [_Z3putPff_param_0];
	cvta.to.global.u64 	%rd2, %rd1;
	mov.u32 	%r1, 1077936128;
	st.global.u32 	[%rd2], %r1;
	ret;

}
	// .globl	callsfunc
.visible .entry callsfunc(
	.param .u64 callsfunc_param_0
)
{
	.reg .b32 	%r<2>;
	.reg .b64 	%rd<4>;


	ld.param.u64 	%rd1, [callsfunc_param_0];
	mov.u32 	%r1, %tid.x;
	mul.wide.u32 	%rd2, %r1, 4;
	add.s64 	%rd3, %rd1, %rd2;
	{ // callseq 0, 0
	.reg .b32 temp_param_reg;
	.param .b64 param0;
	st.param.b64 	[param0+0], %rd3;
	call.uni 
	_Z3putPff, 
	(
	param0
	);
	} // callseq 0
	ret;

}

"#;

    const PRINTF: &str = r#".version 8.8
.target sm_80
.address_size 64

	// .globl	pf
.extern .func  (.param .b32 func_retval0) vprintf
(
	.param .b64 vprintf_param_0,
	.param .b64 vprintf_param_1
)
;
.global .align 1 .b8 $str[7] = {37, 115, 32, 37, 100, 10};

.visible .entry pf(
	.param .u64 pf_param_0
)
{
	.local .align 8 .b8 	__local_depot0[16];
	.reg .b64 	%SP;
	.reg .b64 	%SPL;
	.reg .b32 	%r<3>;
	.reg .b64 	%rd<6>;


	mov.u64 	%SPL, __local_depot0;
	cvta.local.u64 	%SP, %SPL;
	ld.param.u64 	%rd1, [pf_param_0];
	add.u64 	%rd2, %SP, 0;
	add.u64 	%rd3, %SPL, 0;
	mov.u32 	%r1, %tid.x;
	st.local.u64 	[%rd3], %rd1;
	st.local.u32 	[%rd3+8], %r1;
	mov.u64 	%rd4, $str;
	cvta.global.u64 	%rd5, %rd4;
	{ // callseq 0, 0
	.reg .b32 temp_param_reg;
	.param .b64 param0;
	st.param.b64 	[param0+0], %rd5;
	.param .b64 param1;
	st.param.b64 	[param1+0], %rd2;
	.param .b32 retval0;
	call.uni (retval0), 
	vprintf, 
	(
	param0, 
	param1
	);
	ld.param.b32 	%r2, [retval0+0];
	} // callseq 0
	ret;

}

"#;

    const LINEINFO: &str = r#".version 8.8
.target sm_80
.address_size 64

	// .globl	li

.visible .entry li(
	.param .u64 li_param_0,
	.param .u64 li_param_1
)
{
	.reg .f32 	%f<3>;
	.reg .b32 	%r<2>;
	.reg .b64 	%rd<8>;
	.loc	1 1 0


	ld.param.u64 	%rd1, [li_param_0];
	ld.param.u64 	%rd2, [li_param_1];
	.loc	1 1 28
	cvta.to.global.u64 	%rd3, %rd1;
	cvta.to.global.u64 	%rd4, %rd2;
	mov.u32 	%r1, %tid.x;
	mul.wide.s32 	%rd5, %r1, 4;
	add.s64 	%rd6, %rd4, %rd5;
	ld.global.f32 	%f1, [%rd6];
	add.f32 	%f2, %f1, %f1;
	add.s64 	%rd7, %rd3, %rd5;
	st.global.f32 	[%rd7], %f2;
	ret;

}

	.file	1 "li.cu"
"#;

    /// Hand-written, in NVRTC's style: reductions, predicated accesses, generic atomics and vector
    /// stores, an L2 hint, a nested scope and odd indentation.
    const PREDICATED_AND_RED: &str = r#".version 8.8
.target sm_80
.address_size 64

.visible .entry predicated(
	.param .u64 predicated_param_0,
	.param .u64 predicated_param_1
)
{
	.reg .pred 	%p<3>;
	.reg .f32 	%f<6>;
	.reg .b32 	%r<4>;
	.reg .b64 	%rd<6>;

	ld.param.u64 	%rd1, [predicated_param_0];
	ld.param.u64 	%rd2, [predicated_param_1];
	cvta.to.global.u64 	%rd3, %rd1;
	mov.u32 	%r1, %tid.x;
	setp.eq.s32 	%p1, %r1, 0;
	setp.ne.s32 	%p2, %r1, 7;
	mov.f32 	%f1, 0f3F800000;
	@%p1 st.global.f32 	[%rd3+8], %f1;
	@!%p2 ld.global.nc.v2.f32 	{%f2, %f3}, [%rd3+-16];
	red.global.add.u32 	[%rd3], 1;
	red.global.add.f32 	[%rd3+0x10], %f1;
	{
	.reg .b64 	%rd_inner;
	    add.s64 %rd_inner, %rd2, 64;
		atom.add.u32 	%r2, [%rd_inner+8], 1;
	}
  st.v4.f32 [%rd2], {%f1, %f2, %f3, %f1};  // generic vector store
	ld.global.L2::128B.f32 	%f4, [%rd3+4];
	ret;

}
"#;

    /// A kernel calling a `.func` that touches no memory (declared first, as NVRTC does), a kernel
    /// with an empty parameter list, and one with none at all.
    const FUNC_WITHOUT_MEMORY: &str = r#".version 8.8
.target sm_80
.address_size 64

.func  (.param .b32 func_retval0) twice(
	.param .b32 twice_param_0
)
;
.visible .entry noparams()
{
	.reg .b32 	%r<3>;
	.reg .b64 	%rd<2>;

	mov.u32 	%r1, 21;
	{ // callseq 0, 0
	.param .b32 param0;
	st.param.b32 	[param0+0], %r1;
	.param .b32 retval0;
	call.uni (retval0), 
	twice, 
	(
	param0
	);
	ld.param.b32 	%r2, [retval0+0];
	} // callseq 0
	mov.u64 	%rd1, 4096;
	st.global.u32 	[%rd1], %r2;
	ret;

}
.visible .entry bare
{
	ret;
}
.func  (.param .b32 func_retval0) twice(
	.param .b32 twice_param_0
)
{
	.reg .b32 	%r<3>;

	ld.param.u32 	%r1, [twice_param_0];
	shl.b32 	%r2, %r1, 1;
	st.param.b32 	[func_retval0+0], %r2;
	ret;

}
"#;

    /// Every fixture that fences, with its expected entries and count of fenced accesses.
    fn fenceable() -> Vec<(&'static str, &'static str, &'static [&'static str], usize)> {
        vec![
            ("saxpy", SAXPY, &["saxpy"], 5),
            ("vec4", VEC4, &["vec4"], 3),
            ("atomics", ATOMICS, &["atomics"], 5),
            ("atomic_kinds", ATOMIC_KINDS, &["redk"], 4),
            ("generic", GENERIC, &["generic"], 11),
            ("reduce_shared", REDUCE_SHARED, &["reduce"], 2),
            ("out_of_bounds", OUT_OF_BOUNDS, &["oob"], 1),
            ("two_entries", TWO_ENTRIES, &["first", "second"], 3),
            ("global_variables", GLOBAL_VARIABLES, &["gv"], 4),
            ("lineinfo", LINEINFO, &["li"], 2),
            ("predicated_and_red", PREDICATED_AND_RED, &["predicated"], 7),
            ("func_without_memory", FUNC_WITHOUT_MEMORY, &["noparams", "bare"], 1),
        ]
    }

    fn fenced(ptx: &str) -> Fenced {
        fence(ptx).unwrap_or_else(|e| panic!("fence failed: {e}"))
    }

    #[test]
    fn fixtures_fence_and_pass_the_check() {
        for (name, ptx, entries, accesses) in fenceable() {
            let out = fenced(ptx);
            assert_eq!(out.entries, entries, "{name}");
            assert_eq!(out.fenced_accesses, accesses, "{name}");
            assert_eq!(check_fenced(&out.ptx), Ok(accesses), "{name}:\n{}", out.ptx);
            assert_unchanged_apart_from_fence(ptx, &out.ptx);
        }
    }

    #[test]
    fn unfenced_fixtures_fail_the_check() {
        for (name, ptx, _, _) in fenceable() {
            assert!(check_fenced(ptx).is_err(), "{name} passed the check unfenced");
        }
    }

    /// Removes what the rewrite inserts and checks that the rest is the input, byte for byte,
    /// except for rewritten address operands and the comma after a kernel's last parameter.
    fn assert_unchanged_apart_from_fence(input: &str, output: &str) {
        let inserted = |line: &str| {
            let line = line.trim_start();
            line.contains("_agora_fence_")
                || [
                    "and.b64 %agora_fa",
                    "or.b64 %agora_fa",
                    "add.s64 %agora_fa",
                    "mov.b64 %agora_fa",
                ]
                .iter()
                .chain(&[
                    "mov.u64 %agora_fa",
                    "isspacep.global %agora_fp",
                    "@%agora_fp ",
                    ".reg .b64 %agora_fb",
                ])
                .chain(&[
                    ".reg .pred %agora_fp",
                    ".reg .b32 %agora_fl",
                    "mov.u32 %agora_fn",
                    "@%agora_fq ",
                ])
                .chain(&["add.u32 %agora_fn", "setp.ge.u32 %agora_fq"])
                .any(|prefix| line.starts_with(prefix))
        };
        // An empty or missing parameter list gets the fence's: `()` and no list both become `(...)`.
        let kept = output
            .split('\n')
            .filter(|line| !inserted(line))
            .collect::<Vec<_>>()
            .join("\n")
            .replace("(\n)", "()");
        let kept: Vec<&str> = kept.split('\n').collect();
        let original: Vec<&str> = input.split('\n').collect();
        assert_eq!(kept.len(), original.len(), "{output}");
        for (before, after) in original.iter().zip(&kept) {
            if before == after || *after == format!("{before},") || *after == format!("{before}()") {
                continue;
            }
            let (open, close) = (before.find('[').unwrap(), before.find(']').unwrap());
            let rewritten = format!("{}[%agora_fa]{}", &before[..open], &before[close + 1..]);
            assert_eq!(*after, rewritten, "line changed beyond its address operand");
        }
    }

    #[test]
    fn shared_local_and_param_accesses_are_untouched() {
        let out = fenced(REDUCE_SHARED);
        for line in REDUCE_SHARED
            .lines()
            .filter(|l| l.contains(".shared") || l.contains("ld.param"))
        {
            assert!(out.ptx.contains(line), "changed: {line}");
        }
        assert!(out.ptx.contains("\tbar.sync \t0;"));
        let generic = fenced(GENERIC);
        for line in GENERIC
            .lines()
            .filter(|l| l.contains("st.local") || l.contains("st.shared"))
        {
            assert!(generic.ptx.contains(line), "changed: {line}");
        }
        // The one generic load is guarded, so its shared and local targets keep working.
        assert!(generic
            .ptx
            .contains("mov.b64 %agora_fa, %rd18;\n\tisspacep.global %agora_fp, %agora_fa;\n\t"));
        assert!(generic.ptx.contains("\tld.f32 \t%f10, [%agora_fa];"));
    }

    #[test]
    fn address_forms_are_computed_before_masking() {
        let saxpy = fenced(SAXPY).ptx;
        let expected = "\tadd.s64 %agora_fa, %rd5, -4;\n\tand.b64 %agora_fa, %agora_fa, %agora_fm;\n\t\
                        or.b64 %agora_fa, %agora_fa, %agora_fb;\n\tld.global.f32 \t%f5, [%agora_fa];";
        assert!(saxpy.contains(expected), "{saxpy}");
        assert!(saxpy.contains("\tand.b64 %agora_fa, %rd7, %agora_fm;\n"));
        let variables = fenced(GLOBAL_VARIABLES).ptx;
        assert!(variables.contains("\tmov.u64 %agora_fa, table;\n\tadd.s64 %agora_fa, %agora_fa, 12;\n"));
        let kernel = fenced(PREDICATED_AND_RED).ptx;
        // The guard stays on the access; the fence runs unguarded before it.
        assert!(kernel.contains("or.b64 %agora_fa, %agora_fa, %agora_fb;\n\t@%p1 st.global.f32 \t[%agora_fa], %f1;"));
        assert!(kernel.contains("\tadd.s64 %agora_fa, %rd3, 0x10;\n"));
        assert!(
            kernel.contains("\t\tadd.s64 %agora_fa, %rd_inner, 8;\n"),
            "indentation follows the line"
        );
    }

    #[test]
    fn fence_parameters_are_appended_and_loaded() {
        let out = fenced(TWO_ENTRIES).ptx;
        for name in ["first", "second"] {
            assert!(out.contains(&format!(
                "\t.param .u64 {name}_agora_fence_base,\n\t.param .u64 {name}_agora_fence_mask,\n\
                 \t.param .u64 {name}_agora_fence_stop,\n\t.param .u32 {name}_agora_fence_launch\n)"
            )));
            assert!(out.contains(&format!("\tld.param.u32 %agora_fl, [{name}_agora_fence_launch];")));
            assert!(out.contains(&format!("\tld.param.u64 %agora_fm, [{name}_agora_fence_mask];")));
        }
        assert!(out.contains("\t.param .u64 second_param_1,\n\t.param .u64 second_agora_fence_base,"));
        let out = fenced(FUNC_WITHOUT_MEMORY).ptx;
        assert!(out.contains(".entry noparams(\n\t.param .u64 noparams_agora_fence_base,"));
        assert!(out.contains(
            ".entry bare(\n\t.param .u64 bare_agora_fence_base,\n\t.param .u64 bare_agora_fence_mask,\n\
             \t.param .u64 bare_agora_fence_stop,\n\t.param .u32 bare_agora_fence_launch\n)\n{"
        ));
    }

    fn line_of(ptx: &str, needle: &str) -> usize {
        ptx.lines().position(|l| l.contains(needle)).expect("needle in fixture") + 1
    }

    fn assert_unsupported(result: Result<impl std::fmt::Debug, FenceError>, line: usize, needle: &str) {
        match result {
            Err(error) => {
                let FenceError::Unsupported {
                    line: at, instruction, ..
                } = &error
                else {
                    panic!("expected Unsupported at line {line} for {needle}, got {error:?}");
                };
                assert_eq!(*at, line, "{error}");
                assert!(instruction.contains(needle), "{error}");
                assert!(error.to_string().contains("trusted packages may opt out"), "{error}");
            }
            Ok(out) => panic!("expected Unsupported at line {line} for {needle}, got {out:?}"),
        }
    }

    const UNFENCEABLE: [&str; 21] = [
        "cp.async.ca.shared.global [%rd1], [%rd2], 4;",
        "cp.async.bulk.global.shared::cta.bulk_group [%rd1], [%rd2], 64;",
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.u32 [%rd1], [%rd2], 64;",
        "prefetch.global.L2 [%rd1];",
        "prefetchu.L1 [%rd1];",
        "suld.b.1d.v4.b32.trap {%r1, %r2, %r3, %r4}, [%rd1, {%r1}];",
        "sust.b.1d.v4.b32.trap [%rd1, {%r1}], {%r1, %r2, %r3, %r4};",
        "sured.b.add.1d.u32.trap [%rd1, {%r1}], %r2;",
        "tex.1d.v4.f32.s32 {%f1, %f2, %f3, %f4}, [%rd1, {%r1}];",
        "tld4.r.2d.v4.f32.f32 {%f1, %f2, %f3, %f4}, [%rd1, {%f1, %f2}];",
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.u32 [%rd1], %r1, [%rd2];",
        "red.async.relaxed.cluster.shared::cluster.mbarrier::complete_tx::bytes.add.u32 [%rd1], %r1, [%rd2];",
        "multimem.ld_reduce.relaxed.sys.global.add.f32 %f1, [%rd1];",
        "discard.global.L2 [%rd1], 128;",
        "applypriority.global.L2::evict_normal [%rd1], 128;",
        "tensormap.replace.tile.global_address.global.b1024.b64 [%rd1], %rd2;",
        "wmma.load.a.sync.aligned.row.m16n16k16.global.f16 {%r1, %r2}, [%rd1];",
        "mbarrier.arrive.b64 %rd1, [%rd2];",
        "ldmatrix.sync.aligned.m8n8.x1.b16 {%r1}, [%rd1];",
        "st.bulk.weak [%rd1], 64, 0;",
        "fence.proxy.tensormap::generic.acquire.gpu [%rd1], 128;",
    ];

    /// Puts `instruction` before the last `ret;` of `ptx`; returns the text and its line.
    fn inject(ptx: &str, instruction: &str) -> (String, usize) {
        let at = ptx.rfind("\tret;").unwrap();
        let text = format!("{}\t{instruction}\n{}", &ptx[..at], &ptx[at..]);
        let line = ptx[..at].matches('\n').count() + 1;
        (text, line)
    }

    #[test]
    fn unfenceable_instructions_are_refused_with_their_line() {
        for instruction in UNFENCEABLE {
            let (ptx, line) = inject(SAXPY, instruction);
            let opcode = instruction.split_whitespace().next().unwrap();
            assert_unsupported(fence(&ptx), line, opcode);
            // The check refuses them too, on its own grounds, even in otherwise fenced PTX.
            let (fenced_ptx, _) = inject(&fenced(SAXPY).ptx, instruction);
            assert!(check_fenced(&fenced_ptx).is_err(), "check accepted {instruction}");
        }
        // Their shared forms are left alone.
        for instruction in [
            "mbarrier.arrive.shared.b64 %rd1, [%rd2];",
            "ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%r1}, [%rd1];",
            "st.bulk.weak.shared::cta [%rd1], 64, 0;",
        ] {
            let (ptx, _) = inject(SAXPY, instruction);
            assert_eq!(fenced(&ptx).fenced_accesses, 5, "{instruction}");
        }
    }

    #[test]
    fn device_functions_with_global_accesses_are_refused() {
        let line = line_of(FUNC_WITH_STORE, "st.global.u32");
        assert_unsupported(fence(FUNC_WITH_STORE), line, "st.global.u32");
        let message = fence(FUNC_WITH_STORE).unwrap_err().to_string();
        assert!(message.contains("inline it"), "{message}");
        // A generic access in a device function too.
        let generic = FUNC_WITH_STORE.replace("st.global.u32", "st.u32");
        assert_unsupported(fence(&generic), line, "st.u32");
        // And the check refuses a fenced-looking access there.
        assert!(check_fenced(&FUNC_WITH_STORE.replace("[%rd2]", "[%agora_fa]")).is_err());
    }

    #[test]
    fn calls_to_functions_outside_the_module_are_refused() {
        let line = line_of(PRINTF, ".extern .func");
        assert_unsupported(fence(PRINTF), line, "vprintf");
        assert!(check_fenced(PRINTF).is_err());
    }

    #[test]
    fn tampered_output_fails_the_check() {
        let saxpy = fenced(SAXPY).ptx;
        let generic = fenced(GENERIC).ptx;
        let and_line = "\tand.b64 %agora_fa, %rd7, %agora_fm;\n";
        let (with_shadow, _) = inject(&saxpy, "{\n\t.reg .b64 %agora_fm;\n\tmov.b64 %agora_fm, -1;\n\t}");
        let cases: Vec<(&str, String)> = vec![
            ("mask removed", saxpy.replacen(and_line, "", 1)),
            (
                "offset after masking",
                saxpy.replacen("[%agora_fa]", "[%agora_fa+4096]", 1),
            ),
            (
                "label between mask and access",
                saxpy.replacen("\tld.global.f32 \t%f2", "$L_skip:\n\tld.global.f32 \t%f2", 1),
            ),
            (
                "masking predicated",
                saxpy.replacen(and_line, "\t@%p1 and.b64 %agora_fa, %rd7, %agora_fm;\n", 1),
            ),
            ("mask register overwritten", inject(&saxpy, "mov.b64 %agora_fm, -1;").0),
            ("mask register shadowed", with_shadow),
            (
                "prologue load removed",
                saxpy.replacen("\tld.param.u64 %agora_fb, [saxpy_agora_fence_base];\n", "", 1),
            ),
            (
                "fence parameter removed",
                saxpy.replacen(",\n\t.param .u64 saxpy_agora_fence_mask", "", 1),
            ),
            (
                "generic guard wrong space",
                generic.replacen("isspacep.global", "isspacep.shared", 1),
            ),
            (
                "access added after fencing",
                inject(&saxpy, "st.global.f32 [%rd7], %f1;").0,
            ),
            ("generic access added", inject(&saxpy, "st.f32 [%rd7], %f1;").0),
        ];
        for (what, ptx) in cases {
            assert_ne!(ptx, saxpy, "{what}: the edit did not apply");
            assert!(check_fenced(&ptx).is_err(), "{what} passed the check");
        }
    }

    #[test]
    fn every_backward_branch_of_a_kernel_polls_the_stop_word_first() {
        assert_eq!(POLL[1].2[2], POLL_EVERY.to_string(), "the poll's period is POLL_EVERY");
        let poll: String = POLL.iter().map(|p| format!("{}\n\t", poll_text(p))).collect();
        // REDUCE_SHARED loops once (`@%p2 bra $L__BB0_1`); its forward branches get no poll.
        let out = fenced(REDUCE_SHARED).ptx;
        assert_eq!(out.matches("@%agora_fq exit;").count(), 1, "{out}");
        assert!(out.contains(&format!("{poll}@%p2 bra \t$L__BB0_1;")), "{out}");
        assert!(
            !out.contains(&format!("{poll}@%p1 bra")),
            "a forward branch was polled: {out}"
        );
        check_fenced(&out).unwrap();
        // A loop without a poll, or with a poll that is not the pass's, fails the check.
        let tampered: Vec<(&str, String)> = vec![
            ("poll removed", out.replacen(&poll, "", 1)),
            ("exit removed", out.replacen("\t@%agora_fq exit;\n", "", 1)),
            (
                "another launch's number",
                out.replacen("%agora_ft, %agora_fl;", "%agora_ft, %agora_fn;", 1),
            ),
            (
                "never polls",
                out.replacen(
                    "setp.ge.u32 %agora_fq, %agora_fn, 1024;",
                    "setp.ge.u32 %agora_fq, %agora_fn, -1;",
                    1,
                ),
            ),
            ("stop address moved", inject(&out, "add.s64 %agora_fs, %agora_fs, 8;").0),
            ("launch number overwritten", inject(&out, "mov.u32 %agora_fl, 7;").0),
            (
                "stop parameter removed",
                out.replacen(",\n\t.param .u64 reduce_agora_fence_stop", "", 1),
            ),
        ];
        for (what, ptx) in tampered {
            assert_ne!(ptx, out, "{what}: the edit did not apply");
            assert!(check_fenced(&ptx).is_err(), "{what} passed the check");
        }
    }

    #[test]
    fn recursion_among_device_functions_is_refused() {
        // `twice` calling itself: a loop no branch shows.
        let definition = FUNC_WITHOUT_MEMORY.rfind(".func").unwrap();
        let ret = definition + FUNC_WITHOUT_MEMORY[definition..].rfind("\tret;").unwrap();
        let recursive = format!(
            "{}\t{{\n\t.param .b32 p0;\n\tst.param.b32 [p0+0], %r1;\n\t.param .b32 r0;\n\tcall.uni (r0), twice, (p0);\n\t}}\n{}",
            &FUNC_WITHOUT_MEMORY[..ret],
            &FUNC_WITHOUT_MEMORY[ret..]
        );
        let e = fence(&recursive).unwrap_err();
        assert!(e.to_string().contains("recursion"), "{e}");
        assert!(check_fenced(&recursive).is_err());
        // Calls without a cycle are fine (the fixture's kernel calls `twice`).
        fence(FUNC_WITHOUT_MEMORY).unwrap();
    }

    #[test]
    fn calls_through_a_function_pointer_are_refused() {
        // The fixture's call of `twice`, made through a register holding its address instead:
        // what `(*f)(x)` compiles to, and a way to recurse that no call graph shows.
        let direct = "call.uni (retval0), \n\ttwice, \n";
        assert!(FUNC_WITHOUT_MEMORY.contains(direct), "the fixture's call changed");
        let indirect = FUNC_WITHOUT_MEMORY.replacen(direct, "call.uni (retval0), \n\t%rd9, \n", 1);
        let e = fence(&indirect).unwrap_err();
        assert!(e.to_string().contains("through a pointer"), "{e}");
        assert!(check_fenced(&indirect).is_err());
    }

    #[test]
    fn a_device_function_that_loops_is_refused() {
        // `.func` bodies get no fence parameters, so their loops could not be stopped.
        let definition = FUNC_WITHOUT_MEMORY.rfind(".func").unwrap();
        let open = definition + FUNC_WITHOUT_MEMORY[definition..].find('{').unwrap();
        let with_loop = format!(
            "{}\n$L_spin:\n\tbra.uni \t$L_spin;\n{}",
            &FUNC_WITHOUT_MEMORY[..open + 1],
            &FUNC_WITHOUT_MEMORY[open + 1..]
        );
        let e = fence(&with_loop).unwrap_err();
        assert!(e.to_string().contains("loops"), "{e}");
    }

    #[test]
    fn tricks_that_hide_instructions_from_a_line_parser_are_refused() {
        // ptxas takes the rest of a .loc line as the next statement.
        let (hidden, line) = inject(SAXPY, ".loc 1 2 3 ld.global.f32 %f1, [%rd1];");
        assert_eq!(
            fence(&hidden),
            Err(FenceError::Malformed {
                line,
                why: "unexpected arguments after a line directive"
            })
        );
        let (fenced_hidden, _) = inject(&fenced(SAXPY).ptx, ".loc 1 2 3 st.global.f32 [%rd1], %f1;");
        assert!(check_fenced(&fenced_hidden).is_err());
        // A macro would expand after the pass has looked.
        let (macro_text, _) = inject(SAXPY, "#define LOAD ld.global.f32");
        assert!(matches!(fence(&macro_text), Err(FenceError::Malformed { .. })));
        // Two instructions with a missing `;`.
        let (joined, _) = inject(SAXPY, "add.s64 %rd1, %rd1, 4 ld.global.f32 %f1, [%rd1];");
        assert!(matches!(fence(&joined), Err(FenceError::Malformed { .. })));
        // A statement split over lines is seen whole.
        let (split, _) = inject(SAXPY, "st.global.f32\n\t[%rd7+8],\n\t%f1;");
        assert_eq!(fenced(&split).fenced_accesses, 6);
        // Reserved names in the input.
        let (reserved, line) = inject(SAXPY, "mov.b64 %agora_fm, 0;");
        assert_unsupported(fence(&reserved), line, "%agora_fm");
        assert!(matches!(
            fence(&SAXPY.replace(".address_size 64", ".address_size 32")),
            Err(FenceError::Unsupported { .. })
        ));
    }

    #[test]
    fn error_messages_say_what_to_do() {
        let unsupported = FenceError::Unsupported {
            line: 3,
            instruction: "prefetch.global.L2 [%rd1];".into(),
            why: why::CACHE_CONTROL,
        };
        assert!(unsupported
            .to_string()
            .starts_with("line 3: `prefetch.global.L2 [%rd1];`"));
        let unfenced = FenceError::Unfenced {
            line: 9,
            instruction: "st.global.f32 [%rd1], %f1;".into(),
        };
        assert!(unfenced.to_string().contains("fence()"));
        let error: Box<dyn std::error::Error> = Box::new(unfenced);
        assert!(error.to_string().starts_with("line 9"));
    }

    /// Evaluates the fence sequence the rewrite put before the `n`th fenced access, as the GPU would.
    fn run_fence(ptx: &str, n: usize, registers: &[(&str, u64)], is_global: bool) -> u64 {
        let lines: Vec<&str> = ptx.lines().map(str::trim).collect();
        let access = lines
            .iter()
            .enumerate()
            .filter(|(_, l)| l.contains("[%agora_fa]"))
            .nth(n)
            .unwrap()
            .0;
        let start = (0..access)
            .rev()
            .take_while(|&k| lines[k].contains("%agora_fa") && !lines[k].contains("[%agora_fa]"))
            .last()
            .unwrap();
        let mut values: Vec<(String, u64)> = registers.iter().map(|(r, v)| (r.to_string(), *v)).collect();
        let read = |values: &Vec<(String, u64)>, operand: &str| -> u64 {
            match values.iter().find(|(r, _)| r == operand) {
                Some((_, v)) => *v,
                None if operand.starts_with("0x") => u64::from_str_radix(&operand[2..], 16).unwrap(),
                None => operand
                    .parse::<i64>()
                    .unwrap_or_else(|_| panic!("unknown operand {operand}")) as u64,
            }
        };
        for line in &lines[start..access] {
            let (guarded, line) = match line.strip_prefix("@%agora_fp ") {
                Some(rest) => (true, rest),
                None => (false, *line),
            };
            let (opcode, operands) = line.trim_end_matches(';').split_once(' ').unwrap();
            let operands: Vec<&str> = operands.split(", ").collect();
            if guarded && !is_global || opcode == "isspacep.global" {
                continue;
            }
            let (a, b) = (read(&values, operands[1]), operands.get(2).map(|o| read(&values, o)));
            let result = match opcode {
                "mov.b64" | "mov.u64" => a,
                "add.s64" => a.wrapping_add(b.unwrap()),
                "and.b64" => a & b.unwrap(),
                "or.b64" => a | b.unwrap(),
                other => panic!("unexpected {other}"),
            };
            values.retain(|(r, _)| r != operands[0]);
            values.push((operands[0].to_string(), result));
        }
        read(&values, "%agora_fa")
    }

    #[test]
    fn masking_keeps_addresses_inside_the_partition() {
        let size = 1u64 << 20;
        let (base, mask) = fence_arguments(0x7f12_3400_0000, size).unwrap();
        let inside = base..base + size;
        let oob = fenced(OUT_OF_BOUNDS).ptx;
        let fence_regs = |address: u64| [("%rd4", address), ("%agora_fb", base), ("%agora_fm", mask)];
        // Inside: unchanged.
        for address in [base, base + 4, base + size - 4, base + 0x1234] {
            assert_eq!(run_fence(&oob, 0, &fence_regs(address), true), address);
        }
        // Outside (a neighbour's buffer, far away, below, null): lands inside, same offset bits.
        for address in [
            base + size,
            base + (1 << 28) * 4,
            base - 4,
            0,
            u64::MAX - 3,
            0x7f12_3410_0040,
        ] {
            let fenced_address = run_fence(&oob, 0, &fence_regs(address), true);
            assert!(inside.contains(&fenced_address), "{address:#x} -> {fenced_address:#x}");
            assert_eq!(fenced_address & mask, address & mask);
        }
        // A negative offset is applied before masking: `[%rd5+-4]` at the partition's start wraps
        // to its end, not below it.
        let saxpy = fenced(SAXPY).ptx;
        let regs = [("%rd5", base), ("%agora_fb", base), ("%agora_fm", mask)];
        assert_eq!(run_fence(&saxpy, 3, &regs, true), base + size - 4);
        // Generic: a global address is masked, a shared or local one is left as it is.
        let generic = fenced(GENERIC).ptx;
        let regs = [("%rd18", 0x1_0000_0000), ("%agora_fb", base), ("%agora_fm", mask)];
        assert_eq!(run_fence(&generic, 9, &regs, true), base);
        assert_eq!(run_fence(&generic, 9, &regs, false), 0x1_0000_0000);
        // Many addresses: always inside, and unchanged when already inside.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..10_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let fenced_address = (x & mask) | base;
            assert!(inside.contains(&fenced_address));
            assert_eq!((fenced_address & mask) | base, fenced_address);
        }
    }

    #[test]
    fn fence_arguments_need_an_aligned_power_of_two() {
        assert_eq!(fence_arguments(1 << 30, 1 << 20), Some((1 << 30, (1 << 20) - 1)));
        assert_eq!(fence_arguments(1 << 30, 3 << 20), None);
        assert_eq!(fence_arguments((1 << 30) + 4096, 1 << 20), None);
        assert_eq!(fence_arguments(0, 128), None);
        assert_eq!(fence_arguments(0, 0), None);
    }

    /// ptxas from `AGORA_PTXAS`, or the one `scripts/setup.sh` installs into the project's .venv.
    fn ptxas() -> PathBuf {
        crate::cuda::tests::ptxas()
    }

    #[test]
    fn fenced_ptx_assembles_for_sm80_and_sm90() {
        let ptxas = ptxas();
        let dir = std::env::temp_dir().join(format!("agora-fence-ptxas-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (name, ptx, _, _) in fenceable() {
            let path = dir.join(format!("{name}.ptx"));
            std::fs::write(&path, fenced(ptx).ptx).unwrap();
            for arch in ["sm_80", "sm_90"] {
                let output = Command::new(&ptxas)
                    .arg(format!("-arch={arch}"))
                    .args(["-o", "/dev/null"])
                    .arg(&path)
                    .output()
                    .unwrap_or_else(|e| panic!("running {}: {e}", ptxas.display()));
                assert!(
                    output.status.success(),
                    "ptxas -arch={arch} rejected fenced {name}:\n{}",
                    String::from_utf8_lossy(&output.stderr)
                );
            }
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}
