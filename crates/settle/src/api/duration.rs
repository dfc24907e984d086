//! Kubernetes duration strings (`500ms`, `30s`, `1h30m`) as a typed value.
//!
//! The API server checks the text itself with CEL rules carried in the schema below, so a
//! malformed, negative or zero duration never reaches a controller. The Rust parser accepts
//! exactly the language those rules accept: keep the two in step.

use std::borrow::Cow;
use std::fmt;
use std::str::FromStr;
use std::time::Duration as StdDuration;

use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A positive duration written as a Kubernetes (Go) duration string.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Duration(pub StdDuration);

/// Why a duration string was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    #[error(
        "{0:?} is not a duration: write a number and a unit (ns, us, ms, s, m, h), e.g. 500ms, 30s, 5m, 1h30m"
    )]
    Malformed(String),
    #[error("{0:?} is negative: durations here must be greater than zero")]
    Negative(String),
    #[error("{0:?} is too large")]
    Overflow(String),
}

/// The CEL regular expression of a well-formed duration (optionally negative, so that the
/// "negative" rule can give its own message).
pub const DURATION_PATTERN: &str = r"^-?(0|([0-9]+(\.[0-9]+)?(ns|us|ms|s|m|h))+)$";
const ZERO_PATTERN: &str = r"^-?(0|(0+(\.0+)?(ns|us|ms|s|m|h))+)$";

impl Duration {
    pub const fn from_secs(s: u64) -> Self {
        Duration(StdDuration::from_secs(s))
    }
    pub const fn from_millis(ms: u64) -> Self {
        Duration(StdDuration::from_millis(ms))
    }
    pub fn get(self) -> StdDuration {
        self.0
    }
    pub fn is_zero(self) -> bool {
        self.0.is_zero()
    }
}

impl From<StdDuration> for Duration {
    fn from(d: StdDuration) -> Self {
        Duration(d)
    }
}

impl FromStr for Duration {
    type Err = DurationError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let malformed = || DurationError::Malformed(s.to_string());
        let (negative, body) = match s.strip_prefix('-') {
            Some(rest) => (true, rest),
            None => (false, s),
        };
        if body == "0" {
            return Ok(Duration(StdDuration::ZERO));
        }
        if body.is_empty() {
            return Err(malformed());
        }
        let mut total: u128 = 0; // nanoseconds
        let mut rest = body;
        while !rest.is_empty() {
            let int_len = rest.bytes().take_while(u8::is_ascii_digit).count();
            if int_len == 0 {
                return Err(malformed());
            }
            let (int_part, after) = rest.split_at(int_len);
            let (frac_part, after) = match after.strip_prefix('.') {
                Some(f) => {
                    let n = f.bytes().take_while(u8::is_ascii_digit).count();
                    if n == 0 {
                        return Err(malformed());
                    }
                    f.split_at(n)
                }
                None => ("", after),
            };
            let unit_len = after
                .bytes()
                .take_while(|b| b.is_ascii_alphabetic())
                .count();
            let (unit, after) = after.split_at(unit_len);
            let unit_ns: u128 = match unit {
                "ns" => 1,
                "us" => 1_000,
                "ms" => 1_000_000,
                "s" => 1_000_000_000,
                "m" => 60_000_000_000,
                "h" => 3_600_000_000_000,
                _ => return Err(malformed()),
            };
            let overflow = || DurationError::Overflow(s.to_string());
            let int: u128 = int_part.parse().map_err(|_| overflow())?;
            let mut part = int.checked_mul(unit_ns).ok_or_else(overflow)?;
            // Fraction: digits beyond nanosecond precision are dropped, as Go does.
            let mut scale = unit_ns;
            for d in frac_part.bytes() {
                scale /= 10;
                if scale == 0 {
                    break;
                }
                part += u128::from(d - b'0') * scale;
            }
            total = total.checked_add(part).ok_or_else(overflow)?;
            rest = after;
        }
        if negative && total > 0 {
            return Err(DurationError::Negative(s.to_string()));
        }
        let secs = u64::try_from(total / 1_000_000_000)
            .map_err(|_| DurationError::Overflow(s.to_string()))?;
        Ok(Duration(StdDuration::new(
            secs,
            (total % 1_000_000_000) as u32,
        )))
    }
}

impl fmt::Display for Duration {
    /// Formats like Go's `time.Duration.String` (`1h30m0s`, `1.5s`, `250ms`), so what Settle
    /// writes back reads the same as what people write.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ns = self.0.as_nanos();
        if ns == 0 {
            return f.write_str("0s");
        }
        let frac = |value: u128, unit: u128| -> String {
            let whole = value / unit;
            let mut rem = value % unit;
            if rem == 0 {
                return whole.to_string();
            }
            let mut digits = String::new();
            let mut u = unit;
            while rem > 0 {
                u /= 10;
                digits.push(char::from(b'0' + (rem / u) as u8));
                rem %= u;
            }
            format!("{whole}.{digits}")
        };
        if ns < 1_000 {
            return write!(f, "{ns}ns");
        }
        if ns < 1_000_000 {
            return write!(f, "{}us", frac(ns, 1_000));
        }
        if ns < 1_000_000_000 {
            return write!(f, "{}ms", frac(ns, 1_000_000));
        }
        let h = ns / 3_600_000_000_000;
        let m = (ns / 60_000_000_000) % 60;
        let s = ns % 60_000_000_000;
        if h > 0 {
            write!(f, "{h}h{m}m")?;
        } else if m > 0 {
            write!(f, "{m}m")?;
        }
        write!(f, "{}s", frac(s, 1_000_000_000))
    }
}

impl Serialize for Duration {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Duration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = Cow::<'de, str>::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl JsonSchema for Duration {
    fn schema_name() -> Cow<'static, str> {
        "Duration".into()
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "type": "string",
            "maxLength": 64,
            "x-kubernetes-validations": [
                {
                    "rule": format!("self.matches('{}')", DURATION_PATTERN.replace('\\', "\\\\")),
                    "message": "must be a duration such as 500ms, 30s, 5m or 1h30m (a number and a unit: ns, us, ms, s, m, h)",
                },
                {
                    "rule": "!self.startsWith('-')",
                    "message": "must not be negative",
                },
                {
                    "rule": format!("!self.matches('{}')", ZERO_PATTERN.replace('\\', "\\\\")),
                    "message": "must be greater than zero",
                },
            ],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(s: &str) -> Result<StdDuration, DurationError> {
        s.parse::<Duration>().map(Duration::get)
    }

    #[test]
    fn parses_go_durations() {
        assert_eq!(d("1s"), Ok(StdDuration::from_secs(1)));
        assert_eq!(d("1m30s"), Ok(StdDuration::from_secs(90)));
        assert_eq!(d("1.5h"), Ok(StdDuration::from_secs(5400)));
        assert_eq!(d("250ms"), Ok(StdDuration::from_millis(250)));
        assert_eq!(d("10us"), Ok(StdDuration::from_micros(10)));
        assert_eq!(d("1ns"), Ok(StdDuration::from_nanos(1)));
        assert_eq!(d("0"), Ok(StdDuration::ZERO));
        assert_eq!(d("0s"), Ok(StdDuration::ZERO));
    }

    #[test]
    fn refuses_malformed_and_negative() {
        for bad in [
            "",
            "1",
            "s",
            "1x",
            "1.s",
            "one second",
            "1s ",
            "--1s",
            "1S",
            "P1D",
        ] {
            assert!(
                matches!(d(bad), Err(DurationError::Malformed(_))),
                "{bad:?} should be malformed"
            );
        }
        assert!(matches!(d("-1s"), Err(DurationError::Negative(_))));
        assert_eq!(d("-0s"), Ok(StdDuration::ZERO));
    }

    #[test]
    fn formats_like_go() {
        let f = |d: StdDuration| Duration(d).to_string();
        assert_eq!(f(StdDuration::from_secs(90)), "1m30s");
        assert_eq!(f(StdDuration::from_secs(3600)), "1h0m0s");
        assert_eq!(f(StdDuration::from_millis(1500)), "1.5s");
        assert_eq!(f(StdDuration::from_millis(250)), "250ms");
        assert_eq!(f(StdDuration::ZERO), "0s");
        assert_eq!(f(StdDuration::from_nanos(5)), "5ns");
        for s in ["1m30s", "1.5s", "250ms", "1h0m0s", "5ns"] {
            assert_eq!(f(d(s).unwrap()), s, "round trip of {s}");
        }
    }

    #[test]
    fn rust_parser_and_cel_patterns_agree() {
        // The API server evaluates these patterns (RE2) before the Rust parser ever sees a value:
        // whatever the format rule accepts the parser must parse (or call negative), and the zero
        // rule must match exactly the values that parse to zero. Rust's regex crate is RE2-like.
        let format = regex::Regex::new(DURATION_PATTERN).unwrap();
        let zero = regex::Regex::new(ZERO_PATTERN).unwrap();
        let corpus = [
            "1s",
            "1m30s",
            "1.5h",
            "0",
            "-1s",
            "10ns",
            "250ms",
            "3us",
            "1h0m0s",
            "0s",
            "0.0s",
            "00ms",
            "-0s",
            "0h0m0s",
            "0.5s",
            "1",
            "1x",
            "abc",
            "",
            "1.s",
            ".5s",
            "1s ",
            "--1s",
            "1S",
            "P1D",
            "30 seconds",
            "1h-1m",
        ];
        for s in corpus {
            let parsed = d(s);
            let accepted = matches!(parsed, Ok(_) | Err(DurationError::Negative(_)));
            assert_eq!(
                format.is_match(s),
                accepted,
                "format rule vs parser on {s:?}: {parsed:?}"
            );
            if format.is_match(s) {
                let is_zero = parsed.as_ref().is_ok_and(StdDuration::is_zero);
                assert_eq!(zero.is_match(s), is_zero, "zero rule vs parser on {s:?}");
            }
        }
    }
}
