//! The part of Kubernetes' CEL library that offline evaluation provides (see the list in
//! `cel/mod.rs`): regex `find`/`findAll`, list `isSorted`/`sum`, and quantities. A
//! quantity is held as a one-entry map `{"@quantity": value}`: equal quantities are equal
//! values (`quantity('1Gi') == quantity('1024Mi')`), and its member functions read it
//! back.

use std::sync::Arc;

use cel::extractors::{Arguments, This};
use cel::objects::{Key, Map};
use cel::{Context, ExecutionError, Value};

use super::quantity;

type Result<T> = std::result::Result<T, ExecutionError>;

const QUANTITY: &str = "@quantity";

/// Adds the functions to `ctx`.
pub fn define(ctx: &mut Context) -> std::result::Result<(), cel::DeclarationError> {
    ctx.add_function("find", find)?;
    ctx.add_function("findAll", find_all)?;
    ctx.add_function("isSorted", is_sorted)?;
    ctx.add_function("sum", sum)?;
    ctx.add_function("quantity", new_quantity)?;
    ctx.add_function("isQuantity", is_quantity)?;
    ctx.add_function("compareTo", compare_to)?;
    ctx.add_function("isGreaterThan", is_greater_than)?;
    ctx.add_function("isLessThan", is_less_than)?;
    ctx.add_function("asApproximateFloat", as_float)?;
    ctx.add_function("asInteger", as_integer)?;
    ctx.add_function("isInteger", is_integer)?;
    ctx.add_function("sign", sign)?;
    ctx.add_function("add", add)?;
    ctx.add_function("sub", sub)?;
    Ok(())
}

fn error(function: &str, message: impl ToString) -> ExecutionError {
    ExecutionError::function_error(function, message)
}

fn string_arg(function: &str, v: &Value) -> Result<Arc<String>> {
    match v {
        Value::String(s) => Ok(s.clone()),
        other => Err(error(
            function,
            format!("wants a string, not {}", other.type_of()),
        )),
    }
}

fn regex(function: &str, re: &Value) -> Result<regex::Regex> {
    let re = string_arg(function, re)?;
    regex::RegexBuilder::new(&re)
        .size_limit(1 << 20)
        .build()
        .map_err(|e| error(function, e))
}

/// `s.find(re)`: the first match, or `''`.
fn find(This(s): This<Value>, Arguments(args): Arguments) -> Result<Value> {
    let s = string_arg("find", &s)?;
    let re = regex("find", args.first().unwrap_or(&Value::Null))?;
    Ok(Value::String(Arc::new(
        re.find(&s)
            .map(|m| m.as_str().to_string())
            .unwrap_or_default(),
    )))
}

/// `s.findAll(re)`, `s.findAll(re, n)`: the matches (at most `n` when `n` ≥ 0).
fn find_all(This(s): This<Value>, Arguments(args): Arguments) -> Result<Value> {
    let s = string_arg("findAll", &s)?;
    let re = regex("findAll", args.first().unwrap_or(&Value::Null))?;
    let limit = match args.get(1) {
        Some(Value::Int(n)) if *n >= 0 => usize::try_from(*n).unwrap_or(usize::MAX),
        _ => usize::MAX,
    };
    let found = re
        .find_iter(&s)
        .take(limit)
        .map(|m| Value::String(Arc::new(m.as_str().to_string())))
        .collect();
    Ok(Value::List(Arc::new(found)))
}

fn list(function: &str, v: &Value) -> Result<Arc<Vec<Value>>> {
    match v {
        Value::List(l) => Ok(l.clone()),
        other => Err(error(
            function,
            format!("wants a list, not {}", other.type_of()),
        )),
    }
}

/// `l.isSorted()`.
fn is_sorted(This(l): This<Value>) -> Result<bool> {
    let l = list("isSorted", &l)?;
    for pair in l.windows(2) {
        match pair[0].partial_cmp(&pair[1]) {
            Some(std::cmp::Ordering::Greater) => return Ok(false),
            Some(_) => {}
            None => return Err(error("isSorted", "elements that do not compare")),
        }
    }
    Ok(true)
}

/// `l.sum()` of ints or doubles (0 for an empty list).
fn sum(This(l): This<Value>) -> Result<Value> {
    let l = list("sum", &l)?;
    let mut int: i64 = 0;
    let mut float: Option<f64> = None;
    for v in l.iter() {
        match (v, &mut float) {
            (Value::Int(i), None) => {
                int = int
                    .checked_add(*i)
                    .ok_or_else(|| error("sum", "integer overflow"))?;
            }
            (Value::Float(f), None) if int == 0 => float = Some(*f),
            (Value::Float(f), Some(acc)) => *acc += f,
            (other, _) => {
                return Err(error(
                    "sum",
                    format!("cannot add a {} here", other.type_of()),
                ));
            }
        }
    }
    Ok(float.map_or(Value::Int(int), Value::Float))
}

fn quantity_value(q: f64) -> Value {
    let mut map = std::collections::HashMap::new();
    map.insert(Key::String(Arc::new(QUANTITY.to_string())), Value::Float(q));
    Value::Map(Map { map: Arc::new(map) })
}

/// The number a quantity value (or, for `add`/`sub`, an int) stands for.
fn quantity_of(function: &str, v: &Value) -> Result<f64> {
    if let Value::Map(m) = v
        && let Some(Value::Float(q)) = m.map.get(&Key::String(Arc::new(QUANTITY.to_string())))
    {
        return Ok(*q);
    }
    Err(error(
        function,
        format!("wants a quantity, not {}", v.type_of()),
    ))
}

fn new_quantity(Arguments(args): Arguments) -> Result<Value> {
    let s = string_arg("quantity", args.first().unwrap_or(&Value::Null))?;
    quantity::parse(&s)
        .map(quantity_value)
        .map_err(|e| error("quantity", e))
}

fn is_quantity(Arguments(args): Arguments) -> Result<bool> {
    let s = string_arg("isQuantity", args.first().unwrap_or(&Value::Null))?;
    Ok(quantity::parse(&s).is_ok())
}

fn pair(function: &str, this: &Value, args: &[Value]) -> Result<(f64, f64)> {
    let other = args.first().unwrap_or(&Value::Null);
    Ok((quantity_of(function, this)?, quantity_of(function, other)?))
}

fn compare_to(This(q): This<Value>, Arguments(args): Arguments) -> Result<i64> {
    let (a, b) = pair("compareTo", &q, &args)?;
    Ok(match a.partial_cmp(&b) {
        Some(std::cmp::Ordering::Less) => -1,
        Some(std::cmp::Ordering::Greater) => 1,
        _ => 0,
    })
}

fn is_greater_than(This(q): This<Value>, Arguments(args): Arguments) -> Result<bool> {
    let (a, b) = pair("isGreaterThan", &q, &args)?;
    Ok(a > b)
}

fn is_less_than(This(q): This<Value>, Arguments(args): Arguments) -> Result<bool> {
    let (a, b) = pair("isLessThan", &q, &args)?;
    Ok(a < b)
}

fn as_float(This(q): This<Value>) -> Result<f64> {
    quantity_of("asApproximateFloat", &q)
}

fn is_integer(This(q): This<Value>) -> Result<bool> {
    let q = quantity_of("isInteger", &q)?;
    Ok(q.fract() == 0.0 && q.abs() < 9.2e18)
}

fn as_integer(This(q): This<Value>) -> Result<i64> {
    let v = quantity_of("asInteger", &q)?;
    if v.fract() != 0.0 || v.abs() >= 9.2e18 {
        return Err(error("asInteger", "the quantity is not an integer"));
    }
    // Exact: a whole number below 2^63 in magnitude.
    #[allow(clippy::cast_possible_truncation)]
    Ok(v as i64)
}

fn sign(This(q): This<Value>) -> Result<i64> {
    let v = quantity_of("sign", &q)?;
    Ok(if v > 0.0 {
        1
    } else if v < 0.0 {
        -1
    } else {
        0
    })
}

/// The other operand of `add`/`sub`: a quantity or an int.
fn operand(function: &str, args: &[Value]) -> Result<f64> {
    match args.first() {
        #[allow(clippy::cast_precision_loss)]
        Some(Value::Int(i)) => Ok(*i as f64),
        Some(v) => quantity_of(function, v),
        None => Err(error(function, "wants an argument")),
    }
}

fn add(This(q): This<Value>, Arguments(args): Arguments) -> Result<Value> {
    Ok(quantity_value(
        quantity_of("add", &q)? + operand("add", &args)?,
    ))
}

fn sub(This(q): This<Value>, Arguments(args): Arguments) -> Result<Value> {
    Ok(quantity_value(
        quantity_of("sub", &q)? - operand("sub", &args)?,
    ))
}
