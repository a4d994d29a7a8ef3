//! Kubernetes resource quantities (`1Gi`, `500m`, `1.5e3`) as offline CEL sees them: the
//! grammar of `resource.Quantity` (apimachinery's `ParseQuantity`), read into a 64-bit
//! float. Exact for the values quantities usually hold (integers up to 2^53, binary and
//! decimal suffixes); the API server compares them exactly, so two quantities that differ
//! only beyond a double's precision can compare differently offline
//! (docs/reference/admission-cel.md, "Offline CEL").

/// Why a string is not a quantity.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("'{0}' is not a Kubernetes quantity (e.g. 100m, 1Gi, 2.5e3)")]
pub struct QuantityError(pub String);

/// The value of quantity `s`.
pub fn parse(s: &str) -> Result<f64, QuantityError> {
    let bad = || QuantityError(s.to_string());
    if s.is_empty() || s.len() > 64 {
        return Err(bad());
    }
    let (sign, rest) = match s.as_bytes()[0] {
        b'+' => (1.0, &s[1..]),
        b'-' => (-1.0, &s[1..]),
        _ => (1.0, s),
    };
    let digits_end = rest
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(rest.len());
    let (number, suffix) = rest.split_at(digits_end);
    if number.is_empty() || number == "." || number.matches('.').count() > 1 {
        return Err(bad());
    }
    let value: f64 = number.parse().map_err(|_| bad())?;
    let multiplier = multiplier(suffix).ok_or_else(bad)?;
    Ok(sign * value * multiplier)
}

/// The factor a suffix stands for: binary (`Ki`…`Ei`), decimal (`n`…`E`) or an exponent
/// (`e3`, `E-2`).
fn multiplier(suffix: &str) -> Option<f64> {
    let binary = |p: i32| Some(2f64.powi(p));
    let decimal = |p: i32| Some(10f64.powi(p));
    match suffix {
        "" => Some(1.0),
        "Ki" => binary(10),
        "Mi" => binary(20),
        "Gi" => binary(30),
        "Ti" => binary(40),
        "Pi" => binary(50),
        "Ei" => binary(60),
        "n" => decimal(-9),
        "u" => decimal(-6),
        "m" => decimal(-3),
        "k" => decimal(3),
        "M" => decimal(6),
        "G" => decimal(9),
        "T" => decimal(12),
        "P" => decimal(15),
        "E" => decimal(18),
        s => {
            let exp = s.strip_prefix(['e', 'E'])?;
            let digits = exp.strip_prefix(['+', '-']).unwrap_or(exp);
            if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            decimal(exp.parse::<i32>().ok()?.clamp(-400, 400))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_read_as_the_api_server_reads_them() {
        assert_eq!(parse("1Gi"), Ok(1_073_741_824.0));
        assert_eq!(parse("1024Mi"), parse("1Gi"));
        assert_eq!(parse("500m"), Ok(0.5));
        assert_eq!(parse("1.5k"), Ok(1500.0));
        assert_eq!(parse("2e3"), Ok(2000.0));
        assert_eq!(parse("-3"), Ok(-3.0));
        assert_eq!(parse("1E-3"), Ok(0.001));
        for bad in ["", "Gi", "1.2.3", "1Xi", "1e", "1e+", "abc", "1 Gi"] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }
}
