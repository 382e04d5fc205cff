//! Size-rule expressions: parsed by `evalexpr` when a manifest loads, checked there (known
//! variables and functions only, numbers where numbers belong, booleans where conditions
//! belong), and compiled into a flat postfix program that a launch evaluates on a small stack
//! without parsing or allocating.
//!
//! Semantics follow `evalexpr`'s for the operators allowed: integers are `i64` with checked
//! arithmetic (overflow and division by zero are errors, never wrap-around or a panic); an
//! operation with a float operand is done in `f64`; `^` is always a float power. Two
//! deliberate differences: `==`/`!=` compare numbers by value (`2 == 2.0` is true), and
//! `min`/`max` return a float when any argument is a float.

use evalexpr::{DefaultNumericTypes, Node, Operator, Value};

/// Longest expression text accepted.
pub(crate) const MAX_TEXT: usize = 1024;
/// Deepest evaluation stack an expression may need.
pub(crate) const MAX_DEPTH: usize = 16;

/// A value during evaluation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Num {
    Int(i64),
    Float(f64),
    Bool(bool),
}

/// The static type of an expression or variable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ty {
    /// An integer or a float (which one may depend on the values).
    Number,
    /// `true` or `false`.
    Bool,
}

/// Why an evaluation failed: overflow, division by zero, or a value of the wrong kind (a
/// negative or fractional count). The caller blames the launch's scalars or range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct EvalError;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Op {
    Const(Num),
    Var(u8),
    Neg,
    Not,
    Add,
    Sub,
    Mul,
    Div,
    Rem,
    Pow,
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    And,
    Or,
    Min(u8),
    Max(u8),
    If,
    Floor,
    Ceil,
    Round,
    Abs,
    Sqrt,
}

/// The functions an expression may call, with their argument counts (`None`: one or more).
pub(crate) const FUNCTIONS: &[(&str, Option<usize>)] = &[
    ("min", None),
    ("max", None),
    ("if", Some(3)),
    ("floor", Some(1)),
    ("ceil", Some(1)),
    ("round", Some(1)),
    ("math::abs", Some(1)),
    ("math::sqrt", Some(1)),
];

/// A compiled expression.
#[derive(Debug, Clone)]
pub(crate) struct Expr {
    /// The text as written (for messages).
    pub text: String,
    ops: Box<[Op]>,
    /// Variable slots it reads, as a bit set.
    pub vars: u32,
}

/// A variable an expression may read: its name, its slot (below 32) and its type.
pub(crate) type Variable = (String, u8, Ty);

/// Parses and checks `text` against the variables `known`; `want` is the type the result must
/// have. The error is a sentence for the manifest error.
pub(crate) fn compile(text: &str, want: Ty, known: &[Variable]) -> Result<Expr, String> {
    let resolve = |name: &str| known.iter().find(|(n, ..)| n == name).map(|(_, slot, ty)| (*slot, *ty));
    let resolve = &resolve;
    if text.len() > MAX_TEXT {
        return Err(format!("the expression is longer than {MAX_TEXT} bytes"));
    }
    if text.trim().is_empty() {
        return Err("the expression is empty".into());
    }
    let tree: Node<DefaultNumericTypes> =
        evalexpr::build_operator_tree(text).map_err(|e| format!("`{text}` does not parse: {e}"))?;
    // Names first, so an unknown one is reported as such rather than as a type error.
    for name in tree.iter_variable_identifiers() {
        if resolve(name).is_none() {
            let names: Vec<&str> = known.iter().map(|(n, ..)| n.as_str()).collect();
            return Err(format!(
                "`{text}` names `{name}`, which is not a variable here (variables: {})",
                names.join(", ")
            ));
        }
    }
    for name in tree.iter_function_identifiers() {
        if !FUNCTIONS.iter().any(|(f, _)| *f == name) {
            let known: Vec<&str> = FUNCTIONS.iter().map(|(f, _)| *f).collect();
            return Err(format!(
                "`{text}` calls `{name}`, which is not a known function (known: {})",
                known.join(", ")
            ));
        }
    }
    let mut c = Compiler {
        text,
        resolve,
        ops: Vec::new(),
        depth: 0,
        max_depth: 0,
        vars: 0,
    };
    let ty = c.node(&tree)?;
    if ty != want {
        return Err(match want {
            Ty::Number => format!("`{text}` is a condition; a number is needed here"),
            Ty::Bool => format!("`{text}` is a number; a condition (true or false) is needed here"),
        });
    }
    if c.max_depth > MAX_DEPTH {
        return Err(format!("`{text}` is nested too deeply"));
    }
    Ok(Expr {
        text: text.to_string(),
        ops: c.ops.into_boxed_slice(),
        vars: c.vars,
    })
}

struct Compiler<'a> {
    text: &'a str,
    resolve: &'a dyn Fn(&str) -> Option<(u8, Ty)>,
    ops: Vec<Op>,
    depth: usize,
    max_depth: usize,
    vars: u32,
}

impl Compiler<'_> {
    fn emit(&mut self, op: Op, pops: usize) {
        self.depth = self.depth - pops + 1;
        self.max_depth = self.max_depth.max(self.depth);
        self.ops.push(op);
    }

    fn unsupported(&self, what: &str) -> String {
        format!("`{}` uses {what}, which size rules do not support", self.text)
    }

    fn expect(&self, got: Ty, want: Ty, op: &str) -> Result<(), String> {
        if got == want {
            return Ok(());
        }
        Err(match want {
            Ty::Number => format!("`{}`: `{op}` needs numbers, not conditions", self.text),
            Ty::Bool => format!("`{}`: `{op}` needs conditions, not numbers", self.text),
        })
    }

    /// The argument list of a function call node: the tuple's items, or the single argument.
    fn arguments(node: &Node) -> Vec<&Node> {
        let mut n = node;
        while matches!(n.operator(), Operator::RootNode) && n.children().len() == 1 {
            n = &n.children()[0];
        }
        if matches!(n.operator(), Operator::Tuple) {
            n.children().iter().collect()
        } else {
            vec![n]
        }
    }

    fn node(&mut self, node: &Node) -> Result<Ty, String> {
        if self.max_depth > MAX_DEPTH || self.ops.len() > MAX_TEXT {
            return Err(format!("`{}` is nested too deeply", self.text));
        }
        let children = node.children();
        let binary = |c: &mut Self, op: Op, name: &str, arg: Ty, result: Ty| -> Result<Ty, String> {
            if children.len() != 2 {
                return Err(format!("`{}` does not parse: `{name}` needs two operands", c.text));
            }
            let a = c.node(&children[0])?;
            c.expect(a, arg, name)?;
            let b = c.node(&children[1])?;
            c.expect(b, arg, name)?;
            c.emit(op, 2);
            Ok(result)
        };
        use Ty::{Bool, Number};
        match node.operator() {
            Operator::RootNode => match children {
                [only] => self.node(only),
                [] => Err(format!("`{}` has an empty part", self.text)),
                _ => Err(self.unsupported("several expressions")),
            },
            Operator::Add => binary(self, Op::Add, "+", Number, Number),
            Operator::Sub => binary(self, Op::Sub, "-", Number, Number),
            Operator::Mul => binary(self, Op::Mul, "*", Number, Number),
            Operator::Div => binary(self, Op::Div, "/", Number, Number),
            Operator::Mod => binary(self, Op::Rem, "%", Number, Number),
            Operator::Exp => binary(self, Op::Pow, "^", Number, Number),
            Operator::Lt => binary(self, Op::Lt, "<", Number, Bool),
            Operator::Leq => binary(self, Op::Le, "<=", Number, Bool),
            Operator::Gt => binary(self, Op::Gt, ">", Number, Bool),
            Operator::Geq => binary(self, Op::Ge, ">=", Number, Bool),
            Operator::And => binary(self, Op::And, "&&", Bool, Bool),
            Operator::Or => binary(self, Op::Or, "||", Bool, Bool),
            Operator::Eq | Operator::Neq => {
                let (op, name) = if matches!(node.operator(), Operator::Eq) {
                    (Op::Eq, "==")
                } else {
                    (Op::Ne, "!=")
                };
                if children.len() != 2 {
                    return Err(format!("`{}` does not parse: `{name}` needs two operands", self.text));
                }
                let a = self.node(&children[0])?;
                let b = self.node(&children[1])?;
                if a != b {
                    return Err(format!("`{}`: `{name}` compares a number with a condition", self.text));
                }
                self.emit(op, 2);
                Ok(Bool)
            }
            Operator::Neg | Operator::Not => {
                let (op, name, ty) = if matches!(node.operator(), Operator::Neg) {
                    (Op::Neg, "-", Number)
                } else {
                    (Op::Not, "!", Bool)
                };
                let [only] = children else {
                    return Err(format!("`{}` does not parse: `{name}` needs an operand", self.text));
                };
                let a = self.node(only)?;
                self.expect(a, ty, name)?;
                self.emit(op, 1);
                Ok(ty)
            }
            Operator::Const { value } => {
                let (num, ty) = match value {
                    Value::Int(i) => (Num::Int(*i), Number),
                    Value::Float(f) => (Num::Float(*f), Number),
                    Value::Boolean(b) => (Num::Bool(*b), Bool),
                    Value::String(_) => return Err(self.unsupported("a string")),
                    Value::Tuple(_) => return Err(self.unsupported("a tuple")),
                    Value::Empty => return Err(format!("`{}` has an empty part", self.text)),
                };
                self.emit(Op::Const(num), 0);
                Ok(ty)
            }
            Operator::VariableIdentifierRead { identifier } => {
                let (slot, ty) = (self.resolve)(identifier)
                    .ok_or_else(|| format!("`{}` names unknown `{identifier}`", self.text))?;
                self.vars |= 1 << slot;
                self.emit(Op::Var(slot), 0);
                Ok(ty)
            }
            Operator::FunctionIdentifier { identifier } => {
                let [argument] = children else {
                    return Err(self.unsupported("a function without arguments"));
                };
                let args = Self::arguments(argument);
                let count = FUNCTIONS
                    .iter()
                    .find(|(f, _)| f == identifier)
                    .map(|(_, n)| *n)
                    .ok_or_else(|| format!("`{}` calls unknown function `{identifier}`", self.text))?;
                match count {
                    Some(n) if n != args.len() => {
                        return Err(format!(
                            "`{}`: `{identifier}` takes {n} argument{}, not {}",
                            self.text,
                            if n == 1 { "" } else { "s" },
                            args.len()
                        ))
                    }
                    None if args.len() > usize::from(u8::MAX) => return Err(self.unsupported("too many arguments")),
                    _ => {}
                }
                let mut tys = Vec::with_capacity(args.len());
                for a in &args {
                    tys.push(self.node(a)?);
                }
                let n = args.len();
                let (op, result) = match identifier.as_str() {
                    "min" | "max" => {
                        for t in &tys {
                            self.expect(*t, Number, identifier)?;
                        }
                        let op = if identifier == "min" {
                            Op::Min(n as u8)
                        } else {
                            Op::Max(n as u8)
                        };
                        (op, Number)
                    }
                    "if" => {
                        self.expect(tys[0], Bool, "if")?;
                        if tys[1] != tys[2] {
                            return Err(format!(
                                "`{}`: the two branches of `if` must both be numbers or both conditions",
                                self.text
                            ));
                        }
                        (Op::If, tys[1])
                    }
                    other => {
                        self.expect(tys[0], Number, other)?;
                        let op = match other {
                            "floor" => Op::Floor,
                            "ceil" => Op::Ceil,
                            "round" => Op::Round,
                            "math::abs" => Op::Abs,
                            _ => Op::Sqrt,
                        };
                        (op, Number)
                    }
                };
                self.emit(op, n);
                Ok(result)
            }
            Operator::Tuple => Err(self.unsupported("a tuple")),
            Operator::Chain => Err(self.unsupported("`;`")),
            Operator::VariableIdentifierWrite { .. }
            | Operator::Assign
            | Operator::AddAssign
            | Operator::SubAssign
            | Operator::MulAssign
            | Operator::DivAssign
            | Operator::ModAssign
            | Operator::ExpAssign
            | Operator::AndAssign
            | Operator::OrAssign => Err(self.unsupported("an assignment")),
        }
    }
}

fn float(n: Num) -> f64 {
    match n {
        Num::Int(i) => i as f64,
        Num::Float(f) => f,
        Num::Bool(_) => f64::NAN,
    }
}

fn boolean(n: Num) -> Result<bool, EvalError> {
    match n {
        Num::Bool(b) => Ok(b),
        _ => Err(EvalError),
    }
}

#[inline(always)]
fn int_or_float(a: Num, b: Num, int: fn(i64, i64) -> Option<i64>, flt: fn(f64, f64) -> f64) -> Result<Num, EvalError> {
    match (a, b) {
        (Num::Int(x), Num::Int(y)) => int(x, y).map(Num::Int).ok_or(EvalError),
        (Num::Bool(_), _) | (_, Num::Bool(_)) => Err(EvalError),
        _ => Ok(Num::Float(flt(float(a), float(b)))),
    }
}

#[inline(always)]
fn compare(a: Num, b: Num, int: fn(&i64, &i64) -> bool, flt: fn(&f64, &f64) -> bool) -> Result<Num, EvalError> {
    match (a, b) {
        (Num::Int(x), Num::Int(y)) => Ok(Num::Bool(int(&x, &y))),
        (Num::Bool(x), Num::Bool(y)) => Ok(Num::Bool(int(&i64::from(x), &i64::from(y)))),
        (Num::Bool(_), _) | (_, Num::Bool(_)) => Err(EvalError),
        _ => Ok(Num::Bool(flt(&float(a), &float(b)))),
    }
}

impl Expr {
    /// Evaluates with the variable slots `vars` (only the slots in [`Expr::vars`] are read).
    pub(crate) fn eval(&self, vars: &[Num]) -> Result<Num, EvalError> {
        // The most common rules are one variable or constant (`range0`, `n`).
        if let [single] = &*self.ops {
            match *single {
                Op::Const(n) => return Ok(n),
                Op::Var(slot) => return vars.get(usize::from(slot)).copied().ok_or(EvalError),
                _ => {}
            }
        }
        let mut stack = [Num::Int(0); MAX_DEPTH];
        let mut top = 0usize;
        for op in self.ops.iter() {
            // `compile` bounded the depth, so neither index below can leave the stack; `get`
            // keeps even a miscompiled program from panicking.
            macro_rules! pop {
                () => {{
                    top = top.checked_sub(1).ok_or(EvalError)?;
                    *stack.get(top).ok_or(EvalError)?
                }};
            }
            let value = match *op {
                Op::Const(n) => n,
                Op::Var(slot) => *vars.get(usize::from(slot)).ok_or(EvalError)?,
                Op::Neg => match pop!() {
                    Num::Int(i) => Num::Int(i.checked_neg().ok_or(EvalError)?),
                    Num::Float(f) => Num::Float(-f),
                    Num::Bool(_) => return Err(EvalError),
                },
                Op::Not => Num::Bool(!boolean(pop!())?),
                Op::Add | Op::Sub | Op::Mul | Op::Div | Op::Rem | Op::Pow => {
                    let b = pop!();
                    let a = pop!();
                    match *op {
                        Op::Add => int_or_float(a, b, i64::checked_add, |x, y| x + y)?,
                        Op::Sub => int_or_float(a, b, i64::checked_sub, |x, y| x - y)?,
                        Op::Mul => int_or_float(a, b, i64::checked_mul, |x, y| x * y)?,
                        Op::Div => int_or_float(a, b, i64::checked_div, |x, y| x / y)?,
                        Op::Rem => int_or_float(a, b, i64::checked_rem, |x, y| x % y)?,
                        // `^` is a float power whatever its operands (as in evalexpr).
                        _ if matches!(a, Num::Bool(_)) => return Err(EvalError),
                        _ => int_or_float(Num::Float(float(a)), b, |_, _| None, f64::powf)?,
                    }
                }
                Op::Eq | Op::Ne | Op::Lt | Op::Le | Op::Gt | Op::Ge => {
                    let b = pop!();
                    let a = pop!();
                    match *op {
                        Op::Eq => compare(a, b, i64::eq, f64::eq)?,
                        Op::Ne => compare(a, b, i64::ne, f64::ne)?,
                        Op::Lt => compare(a, b, i64::lt, f64::lt)?,
                        Op::Le => compare(a, b, i64::le, f64::le)?,
                        Op::Gt => compare(a, b, i64::gt, f64::gt)?,
                        _ => compare(a, b, i64::ge, f64::ge)?,
                    }
                }
                Op::And | Op::Or => {
                    let b = boolean(pop!())?;
                    let a = boolean(pop!())?;
                    Num::Bool(if *op == Op::And { a && b } else { a || b })
                }
                Op::Min(n) | Op::Max(n) => {
                    let n = usize::from(n);
                    let start = top.checked_sub(n).ok_or(EvalError)?;
                    let args = stack.get(start..top).ok_or(EvalError)?;
                    let min = matches!(op, Op::Min(_));
                    let mut result: Option<Num> = None;
                    for a in args {
                        result = Some(match (result, *a) {
                            (None, a) => a,
                            (Some(Num::Int(x)), Num::Int(y)) => Num::Int(if min { x.min(y) } else { x.max(y) }),
                            (Some(Num::Bool(_)), _) | (_, Num::Bool(_)) => return Err(EvalError),
                            (Some(x), y) => {
                                let (x, y) = (float(x), float(y));
                                Num::Float(if min { x.min(y) } else { x.max(y) })
                            }
                        });
                    }
                    // A single float argument stays a float; mixed lists were made floats above.
                    top = start;
                    result.ok_or(EvalError)?
                }
                Op::If => {
                    let b = pop!();
                    let a = pop!();
                    if boolean(pop!())? {
                        a
                    } else {
                        b
                    }
                }
                Op::Floor | Op::Ceil | Op::Round | Op::Sqrt => {
                    let x = match pop!() {
                        Num::Bool(_) => return Err(EvalError),
                        n => float(n),
                    };
                    Num::Float(match *op {
                        Op::Floor => x.floor(),
                        Op::Ceil => x.ceil(),
                        Op::Round => x.round(),
                        _ => x.sqrt(),
                    })
                }
                Op::Abs => match pop!() {
                    Num::Int(i) => Num::Int(i.checked_abs().ok_or(EvalError)?),
                    Num::Float(f) => Num::Float(f.abs()),
                    Num::Bool(_) => return Err(EvalError),
                },
            };
            *stack.get_mut(top).ok_or(EvalError)? = value;
            top += 1;
        }
        if top != 1 {
            return Err(EvalError);
        }
        Ok(stack[0])
    }

    /// Evaluates to a count: a non-negative integer (an integral float is accepted).
    pub(crate) fn count(&self, vars: &[Num]) -> Result<u64, EvalError> {
        match self.eval(vars)? {
            Num::Int(i) => u64::try_from(i).map_err(|_| EvalError),
            Num::Float(f) if f.is_finite() && f >= 0.0 && f.fract() == 0.0 && f < 9.2e18 => Ok(f as u64),
            _ => Err(EvalError),
        }
    }

    /// Evaluates to a condition.
    pub(crate) fn holds(&self, vars: &[Num]) -> Result<bool, EvalError> {
        boolean(self.eval(vars)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn known() -> Vec<Variable> {
        vec![
            ("n".into(), 0, Ty::Number),
            ("m".into(), 1, Ty::Number),
            ("x".into(), 2, Ty::Number),
            ("b".into(), 3, Ty::Bool),
        ]
    }

    fn eval(text: &str, values: &[Num]) -> Result<Num, EvalError> {
        let want = match compile(text, Ty::Number, &known()) {
            Ok(e) => return e.eval(values),
            Err(_) => Ty::Bool,
        };
        compile(text, want, &known()).unwrap().eval(values)
    }

    #[test]
    fn agrees_with_evalexpr() {
        let values = [Num::Int(7), Num::Int(-3), Num::Float(2.5), Num::Bool(true)];
        let mut context = evalexpr::HashMapContext::<DefaultNumericTypes>::new();
        use evalexpr::ContextWithMutableVariables;
        context.set_value("n".into(), Value::Int(7)).unwrap();
        context.set_value("m".into(), Value::Int(-3)).unwrap();
        context.set_value("x".into(), Value::Float(2.5)).unwrap();
        context.set_value("b".into(), Value::Boolean(true)).unwrap();
        for text in [
            "n + m * 2",
            "n / 2",
            "n % 4",
            "-n / 2",
            "(n + 1) * (m - 1)",
            "n * x",
            "x / 2",
            "n ^ 2",
            "2 ^ 0.5",
            "n > 3 && m < 0",
            "n >= 7 || !b",
            "n == 7",
            "n != m",
            "x == 2.5",
            "min(n, m, 4)",
            "max(n, m)",
            "min(x, 1.5)",
            "if(n > 0, n, 0)",
            "if(b, 1.5, 2.5)",
            "floor(x)",
            "ceil(x)",
            "round(x)",
            "math::abs(m)",
            "math::abs(-x)",
            "math::sqrt(n)",
            "ceil(n / 2.0) * 2",
            "(n + 63) / 64 * 64",
            "n - -m",
            "2 ^ 3 ^ 2",
            "-2 ^ 2",
        ] {
            let expected = evalexpr::eval_with_context(text, &context).unwrap();
            let expected = match expected {
                Value::Int(i) => Num::Int(i),
                Value::Float(f) => Num::Float(f),
                Value::Boolean(b) => Num::Bool(b),
                other => panic!("{text}: {other:?}"),
            };
            assert_eq!(eval(text, &values), Ok(expected), "{text}");
        }
    }

    #[test]
    fn errors_are_values_not_panics() {
        let values = [Num::Int(i64::MAX), Num::Int(0), Num::Float(f64::NAN), Num::Bool(false)];
        for text in ["n + 1", "n * 2", "-n - 2", "n / m", "n % m", "math::abs(-n - 1)"] {
            assert_eq!(eval(text, &values), Err(EvalError), "{text}");
        }
        let e = compile("x", Ty::Number, &known()).unwrap();
        assert_eq!(e.count(&values), Err(EvalError), "NaN is not a count");
        let e = compile("m - 1", Ty::Number, &known()).unwrap();
        assert_eq!(e.count(&values), Err(EvalError), "negative");
        let e = compile("n / 2 + 0.5", Ty::Number, &known()).unwrap();
        let seven = [Num::Int(7), Num::Int(0), Num::Float(0.0), Num::Bool(true)];
        assert_eq!(e.count(&seven), Err(EvalError), "fraction");
        let e = compile("max(n)", Ty::Number, &known()).unwrap();
        assert_eq!(e.count(&seven), Ok(7), "max of one");
        let e = compile("ceil(n / 4.0)", Ty::Number, &known()).unwrap();
        assert_eq!(
            e.count(&[Num::Int(9), Num::Int(0), Num::Float(0.0), Num::Bool(true)]),
            Ok(3)
        );
    }

    #[test]
    fn refuses_at_compile_time() {
        for (text, want, message) in [
            ("n +", Ty::Number, "does not parse"),
            ("q + 1", Ty::Number, "`q`, which is not a variable"),
            ("n > 1", Ty::Number, "a number is needed"),
            ("n + 1", Ty::Bool, "a condition (true or false) is needed"),
            ("b + 1", Ty::Number, "needs numbers"),
            ("n && b", Ty::Bool, "needs conditions"),
            ("n = 3", Ty::Number, "assignment"),
            ("1; 2", Ty::Number, "`;`"),
            ("\"s\"", Ty::Number, "string"),
            ("str::trim(n)", Ty::Number, "not a known function"),
            ("n m", Ty::Number, "not a known function"),
            ("if(b, 1)", Ty::Number, "takes 3 arguments"),
            ("if(b, 1, b)", Ty::Number, "both be numbers"),
            ("", Ty::Number, "empty"),
            ("b == 1", Ty::Bool, "compares a number with a condition"),
        ] {
            let err = compile(text, want, &known()).unwrap_err();
            assert!(err.contains(message), "{text}: {err}");
        }
        let deep = format!("{}n{}", "(".repeat(40), ")".repeat(40));
        compile(&deep, Ty::Number, &known()).unwrap();
        let deep = format!("{}n{}", "(1 + ".repeat(40), ")".repeat(40));
        assert!(compile(&deep, Ty::Number, &known()).unwrap_err().contains("nested"));
    }

    /// Whatever the text, compiling and evaluating return; they never panic or overflow the
    /// stack.
    #[test]
    fn hostile_expressions_do_not_panic() {
        let half = MAX_TEXT / 2;
        for text in [
            format!("{}n{}", "(".repeat(half - 1), ")".repeat(half - 1)),
            format!("{}n", "-".repeat(MAX_TEXT - 1)),
            format!("{}n", "!".repeat(MAX_TEXT - 1)),
            format!("{}1", "min(".repeat(200)),
            "n ^ n ^ n ^ n".into(),
            "1e308 * 1e308".into(),
            "9223372036854775807 + 1".into(),
            "99999999999999999999".into(),
        ] {
            if let Ok(e) = compile(&text, Ty::Number, &known()) {
                let _ = e.count(&[Num::Int(3), Num::Int(0), Num::Float(0.5), Num::Bool(true)]);
            }
        }
        let alphabet: Vec<char> = "nmxb0123456789.+-*/%^()<>=!&|, ifmaxcel:\"".chars().collect();
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..20_000 {
            let len = (state % 24) as usize + 1;
            let text: String = (0..len)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    alphabet[(state % alphabet.len() as u64) as usize]
                })
                .collect();
            for want in [Ty::Number, Ty::Bool] {
                if let Ok(e) = compile(&text, want, &known()) {
                    let _ = e.eval(&[Num::Int(i64::MIN), Num::Int(-1), Num::Float(f64::NAN), Num::Bool(true)]);
                    let _ = e.eval(&[Num::Int(0), Num::Int(0), Num::Float(0.0), Num::Bool(false)]);
                }
            }
        }
    }

    #[test]
    fn records_the_variables_it_reads() {
        let e = compile("n * 2 + max(x, 1)", Ty::Number, &known()).unwrap();
        assert_eq!(e.vars, 0b101);
    }
}
