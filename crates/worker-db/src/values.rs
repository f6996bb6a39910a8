//! Conversion between database values and JSON.
//!
//! Results: integers exact (JSON numbers), NUMERIC/DECIMAL as strings, floats as numbers
//! (NaN and infinities as strings), text, bytes as base64, null, bool, dates and
//! timestamps as ISO-8601, json/jsonb as JSON, uuid as string, arrays as JSON arrays.
//! Parameters: JSON scalars, sent to PostgreSQL in text format so the server converts
//! them to whatever type it inferred for the placeholder.

use base64::Engine as _;
use chrono::{DateTime, Duration, NaiveDate, NaiveDateTime, NaiveTime, SecondsFormat};
use serde_json::{Map, Number, Value, json};
use tokio_postgres::types::{Format, FromSql, IsNull, Kind, ToSql, Type, to_sql_checked};

/// A value that cannot be used as a parameter, a PostgreSQL value that did not decode, or
/// a result row too large to return.
#[derive(Debug, thiserror::Error)]
pub enum ValueError {
    #[error("params[{index}] is {kind}; parameters must be strings, numbers, booleans or null")]
    NotScalar { index: usize, kind: &'static str },
    #[error("malformed {0} value from the server")]
    Malformed(&'static str),
    #[error(
        "the first row of the result alone is larger than the {max} bytes one result may \
         hold, so nothing is returned; select fewer or shorter columns, e.g. \
         substr(column, 1, 1000), length(column) or a hash of the column"
    )]
    FirstRowTooLarge { max: usize },
    #[error(
        "a {0} value in the result is outside the years -262143 to 262142 that results are \
         given in; cast that column to text in the query (e.g. column::text)"
    )]
    OutOfRange(&'static str),
}

/// The approximate size of a JSON value in a result, as the result caps count it.
pub(crate) fn approx_len(v: &Value) -> usize {
    match v {
        Value::String(s) => s.len() + 2,
        Value::Array(a) => a.iter().map(approx_len).sum::<usize>() + 2,
        Value::Object(o) => o.iter().map(|(k, v)| k.len() + approx_len(v) + 4).sum(),
        _ => 8,
    }
}

/// The size a SQLite value will have in the result, known before it is converted.
pub(crate) fn sqlite_json_len(value: rusqlite::types::ValueRef<'_>) -> usize {
    use rusqlite::types::ValueRef as V;
    match value {
        V::Text(t) => t.len() + 2,
        V::Blob(b) => base64_len(b.len()) + 2,
        V::Null | V::Integer(_) | V::Real(_) => 8,
    }
}

/// The size a PostgreSQL value of `raw_len` wire bytes will have in the result, at least
/// roughly, known before it is decoded (bytes grow by a third as base64).
pub(crate) fn pg_json_len(ty: &Type, raw_len: usize) -> usize {
    if *ty == Type::BYTEA {
        base64_len(raw_len) + 2
    } else {
        raw_len.max(6) + 2
    }
}

fn base64_len(n: usize) -> usize {
    n.div_ceil(3).saturating_mul(4)
}

/// The wire size of one PostgreSQL value (0 for NULL), read without decoding it.
pub(crate) struct RawLen(pub usize);

impl<'a> FromSql<'a> for RawLen {
    fn from_sql(
        _ty: &Type,
        raw: &'a [u8],
    ) -> Result<Self, Box<dyn std::error::Error + Sync + Send>> {
        Ok(RawLen(raw.len()))
    }

    fn from_sql_null(_ty: &Type) -> Result<Self, Box<dyn std::error::Error + Sync + Send>> {
        Ok(RawLen(0))
    }

    fn accepts(_ty: &Type) -> bool {
        true
    }
}

pub(crate) fn base64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn float(f: f64) -> Value {
    match Number::from_f64(f) {
        Some(n) => Value::Number(n),
        None if f.is_nan() => json!("NaN"),
        None if f > 0.0 => json!("Infinity"),
        None => json!("-Infinity"),
    }
}

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
        _ => "a scalar",
    }
}

/// A parameter for PostgreSQL, sent in text format.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum TextParam {
    Null,
    Text(String),
}

/// Converts the `params` argument for PostgreSQL.
pub(crate) fn pg_params(params: &[Value]) -> Result<Vec<TextParam>, ValueError> {
    params
        .iter()
        .enumerate()
        .map(|(index, v)| match v {
            Value::Null => Ok(TextParam::Null),
            Value::Bool(b) => Ok(TextParam::Text(b.to_string())),
            Value::Number(n) => Ok(TextParam::Text(n.to_string())),
            Value::String(s) => Ok(TextParam::Text(s.clone())),
            other => Err(ValueError::NotScalar {
                index,
                kind: kind_of(other),
            }),
        })
        .collect()
}

impl ToSql for TextParam {
    fn to_sql(
        &self,
        _ty: &Type,
        out: &mut bytes::BytesMut,
    ) -> Result<IsNull, Box<dyn std::error::Error + Sync + Send>> {
        match self {
            TextParam::Null => Ok(IsNull::Yes),
            TextParam::Text(s) => {
                out.extend_from_slice(s.as_bytes());
                Ok(IsNull::No)
            }
        }
    }

    fn accepts(_ty: &Type) -> bool {
        true
    }

    fn encode_format(&self, _ty: &Type) -> Format {
        Format::Text
    }

    to_sql_checked!();
}

/// Converts the `params` argument for SQLite (booleans become 0/1).
pub(crate) fn sqlite_params(params: &[Value]) -> Result<Vec<rusqlite::types::Value>, ValueError> {
    use rusqlite::types::Value as V;
    params
        .iter()
        .enumerate()
        .map(|(index, v)| match v {
            Value::Null => Ok(V::Null),
            Value::Bool(b) => Ok(V::Integer(i64::from(*b))),
            Value::Number(n) => Ok(match (n.as_i64(), n.as_f64()) {
                (Some(i), _) => V::Integer(i),
                (None, Some(f)) => V::Real(f),
                (None, None) => V::Text(n.to_string()),
            }),
            Value::String(s) => Ok(V::Text(s.clone())),
            other => Err(ValueError::NotScalar {
                index,
                kind: kind_of(other),
            }),
        })
        .collect()
}

/// Converts one SQLite value, guided by the column's declared type where SQLite's
/// dynamic typing leaves a choice (booleans, decimals, json, uuid blobs).
pub(crate) fn sqlite_value(value: rusqlite::types::ValueRef<'_>, decl: &str) -> Value {
    use rusqlite::types::ValueRef as V;
    let decl = decl.to_ascii_lowercase();
    let decimal = decl.starts_with("numeric") || decl.starts_with("decimal");
    match value {
        V::Null => Value::Null,
        V::Integer(i) if decl.starts_with("bool") => Value::Bool(i != 0),
        V::Integer(i) if decimal => Value::String(i.to_string()),
        V::Integer(i) => json!(i),
        V::Real(f) if decimal => Value::String(f.to_string()),
        V::Real(f) => float(f),
        V::Text(t) => {
            let text = String::from_utf8_lossy(t).into_owned();
            if decl == "json" || decl == "jsonb" {
                serde_json::from_str(&text).unwrap_or(Value::String(text))
            } else {
                Value::String(text)
            }
        }
        V::Blob(b) if decl == "uuid" && b.len() == 16 => Value::String(uuid_string(b)),
        V::Blob(b) => Value::String(base64(b)),
    }
}

/// The storage class of a SQLite value, used as the column type when none is declared.
pub(crate) fn sqlite_storage_class(value: rusqlite::types::ValueRef<'_>) -> &'static str {
    use rusqlite::types::ValueRef as V;
    match value {
        V::Null => "null",
        V::Integer(_) => "integer",
        V::Real(_) => "real",
        V::Text(_) => "text",
        V::Blob(_) => "blob",
    }
}

fn uuid_string(b: &[u8]) -> String {
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    if hex.len() != 32 {
        return hex;
    }
    format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

/// One PostgreSQL value as JSON, decoded from the binary wire format.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PgJson(pub Value);

impl<'a> FromSql<'a> for PgJson {
    fn from_sql(
        ty: &Type,
        raw: &'a [u8],
    ) -> Result<Self, Box<dyn std::error::Error + Sync + Send>> {
        Ok(PgJson(decode(ty, raw)?))
    }

    fn from_sql_null(_ty: &Type) -> Result<Self, Box<dyn std::error::Error + Sync + Send>> {
        Ok(PgJson(Value::Null))
    }

    fn accepts(_ty: &Type) -> bool {
        true
    }
}

struct Reader<'a> {
    buf: &'a [u8],
    what: &'static str,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], ValueError> {
        if self.buf.len() < n {
            return Err(ValueError::Malformed(self.what));
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], ValueError> {
        self.take(N)?
            .try_into()
            .map_err(|_| ValueError::Malformed(self.what))
    }
    fn i16(&mut self) -> Result<i16, ValueError> {
        Ok(i16::from_be_bytes(self.array()?))
    }
    fn u16(&mut self) -> Result<u16, ValueError> {
        Ok(u16::from_be_bytes(self.array()?))
    }
    fn i32(&mut self) -> Result<i32, ValueError> {
        Ok(i32::from_be_bytes(self.array()?))
    }
    fn u32(&mut self) -> Result<u32, ValueError> {
        Ok(u32::from_be_bytes(self.array()?))
    }
    fn i64(&mut self) -> Result<i64, ValueError> {
        Ok(i64::from_be_bytes(self.array()?))
    }
}

fn pg_epoch() -> NaiveDateTime {
    NaiveDate::from_ymd_opt(2000, 1, 1)
        .unwrap_or_default()
        .and_time(NaiveTime::MIN)
}

fn text(raw: &[u8]) -> Value {
    Value::String(String::from_utf8_lossy(raw).into_owned())
}

fn decode(ty: &Type, raw: &[u8]) -> Result<Value, ValueError> {
    let mut r = Reader {
        buf: raw,
        what: "binary",
    };
    let v = match *ty {
        Type::BOOL => Value::Bool(r.array::<1>()?[0] != 0),
        Type::INT2 => json!(r.i16()?),
        Type::INT4 => json!(r.i32()?),
        Type::INT8 => json!(r.i64()?),
        Type::OID | Type::XID | Type::CID | Type::REGCLASS | Type::REGPROC | Type::REGTYPE => {
            json!(r.u32()?)
        }
        Type::FLOAT4 => float(f64::from(f32::from_be_bytes(r.array()?))),
        Type::FLOAT8 => float(f64::from_be_bytes(r.array()?)),
        Type::NUMERIC => Value::String(numeric(raw)?),
        Type::MONEY => {
            let cents = r.i64()?;
            let sign = if cents < 0 { "-" } else { "" };
            let abs = cents.unsigned_abs();
            Value::String(format!("{sign}{}.{:02}", abs / 100, abs % 100))
        }
        Type::CHAR => Value::String(char::from(r.array::<1>()?[0]).to_string()),
        Type::TEXT
        | Type::VARCHAR
        | Type::BPCHAR
        | Type::NAME
        | Type::UNKNOWN
        | Type::XML
        | Type::JSONPATH
        | Type::REFCURSOR => text(raw),
        Type::BYTEA => Value::String(base64(raw)),
        Type::JSON => serde_json::from_slice(raw).map_err(|_| ValueError::Malformed("json"))?,
        Type::JSONB => {
            let body = raw.get(1..).ok_or(ValueError::Malformed("jsonb"))?;
            serde_json::from_slice(body).map_err(|_| ValueError::Malformed("jsonb"))?
        }
        Type::UUID => Value::String(uuid_string(raw)),
        Type::DATE => match r.i32()? {
            i32::MAX => json!("infinity"),
            i32::MIN => json!("-infinity"),
            days => {
                // PostgreSQL's dates reach year 5874897, chrono's 262142: checked, so a
                // value beyond is an error naming the fix, not a panic of the worker.
                let d = pg_epoch()
                    .date()
                    .checked_add_signed(Duration::days(i64::from(days)))
                    .ok_or(ValueError::OutOfRange("date"))?;
                Value::String(d.format("%Y-%m-%d").to_string())
            }
        },
        Type::TIMESTAMP => match r.i64()? {
            i64::MAX => json!("infinity"),
            i64::MIN => json!("-infinity"),
            us => {
                let t = pg_epoch()
                    .checked_add_signed(Duration::microseconds(us))
                    .ok_or(ValueError::OutOfRange("timestamp"))?;
                Value::String(t.format("%Y-%m-%dT%H:%M:%S%.f").to_string())
            }
        },
        Type::TIMESTAMPTZ => match r.i64()? {
            i64::MAX => json!("infinity"),
            i64::MIN => json!("-infinity"),
            us => {
                let t = pg_epoch()
                    .checked_add_signed(Duration::microseconds(us))
                    .ok_or(ValueError::OutOfRange("timestamptz"))?
                    .and_utc();
                Value::String(DateTime::to_rfc3339_opts(&t, SecondsFormat::AutoSi, true))
            }
        },
        Type::TIME => Value::String(time_of_day(r.i64()?)),
        Type::TIMETZ => {
            let us = r.i64()?;
            // PostgreSQL stores the offset in seconds west of UTC.
            let west = r.i32()?;
            let east = -west;
            let sign = if east < 0 { '-' } else { '+' };
            let a = east.unsigned_abs();
            Value::String(format!(
                "{}{sign}{:02}:{:02}",
                time_of_day(us),
                a / 3600,
                (a % 3600) / 60
            ))
        }
        Type::INTERVAL => {
            let us = r.i64()?;
            let days = r.i32()?;
            let months = r.i32()?;
            Value::String(interval(months, days, us))
        }
        Type::INET | Type::CIDR => Value::String(inet(raw, *ty == Type::CIDR)?),
        _ => match ty.kind() {
            Kind::Array(elem) => array(elem, raw)?,
            Kind::Domain(base) => decode(base, raw)?,
            Kind::Enum(_) => text(raw),
            Kind::Composite(fields) => composite(fields, raw)?,
            _ => Value::String(format!(
                "<value of type {}: not shown; cast it in SQL, e.g. column::text>",
                ty.name()
            )),
        },
    };
    Ok(v)
}

fn time_of_day(us: i64) -> String {
    let t = NaiveTime::MIN + Duration::microseconds(us);
    t.format("%H:%M:%S%.f").to_string()
}

/// ISO-8601 duration, e.g. `P1Y2M3DT4H5M6.5S`.
fn interval(months: i32, days: i32, us: i64) -> String {
    let mut s = String::from("P");
    let (y, m) = (months / 12, months % 12);
    if y != 0 {
        s.push_str(&format!("{y}Y"));
    }
    if m != 0 {
        s.push_str(&format!("{m}M"));
    }
    if days != 0 {
        s.push_str(&format!("{days}D"));
    }
    if us != 0 {
        s.push('T');
        let (h, rest) = (us / 3_600_000_000, us % 3_600_000_000);
        let (min, rest) = (rest / 60_000_000, rest % 60_000_000);
        if h != 0 {
            s.push_str(&format!("{h}H"));
        }
        if min != 0 {
            s.push_str(&format!("{min}M"));
        }
        if rest != 0 {
            let secs = rest as f64 / 1_000_000.0;
            s.push_str(&format!("{secs}S"));
        }
    }
    if s == "P" {
        s.push_str("T0S");
    }
    s
}

fn inet(raw: &[u8], cidr: bool) -> Result<String, ValueError> {
    let mut r = Reader {
        buf: raw,
        what: "inet",
    };
    let [family, bits, _is_cidr, len] = r.array::<4>()?;
    let addr = r.take(usize::from(len))?;
    let ip = match (family, addr.len()) {
        (2, 4) => std::net::IpAddr::from([addr[0], addr[1], addr[2], addr[3]]),
        (3, 16) => {
            let mut a = [0u8; 16];
            a.copy_from_slice(addr);
            std::net::IpAddr::from(a)
        }
        _ => return Err(ValueError::Malformed("inet")),
    };
    let full = if ip.is_ipv4() { 32 } else { 128 };
    Ok(if cidr || bits != full {
        format!("{ip}/{bits}")
    } else {
        ip.to_string()
    })
}

fn array(elem: &Type, raw: &[u8]) -> Result<Value, ValueError> {
    let mut r = Reader {
        buf: raw,
        what: "array",
    };
    let ndim = usize::try_from(r.i32()?).map_err(|_| ValueError::Malformed("array"))?;
    let _has_null = r.i32()?;
    let _elem_oid = r.u32()?;
    let mut dims = Vec::with_capacity(ndim.min(6));
    for _ in 0..ndim {
        dims.push(usize::try_from(r.i32()?).map_err(|_| ValueError::Malformed("array"))?);
        let _lower_bound = r.i32()?;
    }
    if dims.is_empty() {
        return Ok(Value::Array(Vec::new()));
    }
    let total: usize = dims.iter().product();
    let mut flat = Vec::with_capacity(total.min(1 << 16));
    for _ in 0..total {
        let len = r.i32()?;
        if len < 0 {
            flat.push(Value::Null);
        } else {
            let bytes =
                r.take(usize::try_from(len).map_err(|_| ValueError::Malformed("array"))?)?;
            flat.push(decode(elem, bytes)?);
        }
    }
    // Fold the flat list into nested arrays, innermost dimension first.
    for &dim in dims.iter().skip(1).rev() {
        let mut nested = Vec::with_capacity(flat.len() / dim.max(1));
        let mut it = flat.into_iter();
        loop {
            let chunk: Vec<Value> = it.by_ref().take(dim).collect();
            if chunk.is_empty() {
                break;
            }
            nested.push(Value::Array(chunk));
        }
        flat = nested;
    }
    Ok(Value::Array(flat))
}

fn composite(fields: &[tokio_postgres::types::Field], raw: &[u8]) -> Result<Value, ValueError> {
    let mut r = Reader {
        buf: raw,
        what: "record",
    };
    let n = r.i32()?;
    let mut out = Map::new();
    for i in 0..usize::try_from(n).map_err(|_| ValueError::Malformed("record"))? {
        let _oid = r.u32()?;
        let len = r.i32()?;
        let field = fields.get(i).ok_or(ValueError::Malformed("record"))?;
        let v = if len < 0 {
            Value::Null
        } else {
            let bytes =
                r.take(usize::try_from(len).map_err(|_| ValueError::Malformed("record"))?)?;
            decode(field.type_(), bytes)?
        };
        out.insert(field.name().to_owned(), v);
    }
    Ok(Value::Object(out))
}

/// The text form of a binary NUMERIC (base-10000 digits), exact.
fn numeric(raw: &[u8]) -> Result<String, ValueError> {
    let mut r = Reader {
        buf: raw,
        what: "numeric",
    };
    let ndigits = r.i16()?;
    let weight = i32::from(r.i16()?);
    let sign = r.u16()?;
    let dscale = usize::from(r.u16()?);
    let mut digits = Vec::with_capacity(usize::try_from(ndigits).unwrap_or(0));
    for _ in 0..ndigits {
        digits.push(r.i16()?);
    }
    match sign {
        0xC000 => return Ok("NaN".into()),
        0xD000 => return Ok("Infinity".into()),
        0xF000 => return Ok("-Infinity".into()),
        _ => {}
    }
    let digit = |i: i32| -> i16 {
        usize::try_from(i)
            .ok()
            .and_then(|i| digits.get(i).copied())
            .unwrap_or(0)
    };
    let mut s = String::new();
    if sign == 0x4000 {
        s.push('-');
    }
    if weight < 0 {
        s.push('0');
    } else {
        for i in 0..=weight {
            if i == 0 {
                s.push_str(&digit(i).to_string());
            } else {
                s.push_str(&format!("{:04}", digit(i)));
            }
        }
    }
    if dscale > 0 {
        let mut frac = String::new();
        let mut i = weight + 1;
        while frac.len() < dscale {
            frac.push_str(&format!("{:04}", digit(i)));
            i += 1;
        }
        frac.truncate(dscale);
        s.push('.');
        s.push_str(&frac);
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn num(ndigits: &[i16], weight: i16, sign: u16, dscale: u16) -> String {
        let mut raw = Vec::new();
        raw.extend_from_slice(&(ndigits.len() as i16).to_be_bytes());
        raw.extend_from_slice(&weight.to_be_bytes());
        raw.extend_from_slice(&sign.to_be_bytes());
        raw.extend_from_slice(&dscale.to_be_bytes());
        for d in ndigits {
            raw.extend_from_slice(&d.to_be_bytes());
        }
        numeric(&raw).unwrap()
    }

    #[test]
    fn numeric_text_is_exact() {
        assert_eq!(num(&[1, 2345, 6789], 1, 0, 4), "12345.6789");
        assert_eq!(num(&[1000], -2, 0, 5), "0.00001");
        assert_eq!(num(&[], 0, 0, 0), "0");
        assert_eq!(num(&[12], 0, 0x4000, 2), "-12.00");
        assert_eq!(num(&[1], 2, 0, 0), "100000000");
        assert_eq!(num(&[], 0, 0xC000, 0), "NaN");
    }

    #[test]
    fn intervals_and_params() {
        assert_eq!(interval(14, 3, 3_723_500_000), "P1Y2M3DT1H2M3.5S");
        assert_eq!(interval(0, 0, 0), "PT0S");
        assert_eq!(
            pg_params(&[json!(1), json!(true), json!("x"), Value::Null]).unwrap(),
            vec![
                TextParam::Text("1".into()),
                TextParam::Text("true".into()),
                TextParam::Text("x".into()),
                TextParam::Null
            ]
        );
        assert!(pg_params(&[json!([1])]).is_err());
        assert!(sqlite_params(&[json!({"a": 1})]).is_err());
    }

    #[test]
    fn sizes_are_known_before_conversion() {
        use rusqlite::types::ValueRef as V;
        for (raw, decl) in [
            (V::Text(b"hello"), ""),
            (V::Blob(b"hello!!"), "BLOB"),
            (V::Blob(&[0u8; 3000]), ""),
            (V::Integer(7), ""),
        ] {
            assert_eq!(
                sqlite_json_len(raw),
                approx_len(&sqlite_value(raw, decl)),
                "{raw:?}"
            );
        }
        assert_eq!(
            pg_json_len(&Type::BYTEA, 3000),
            base64(&[0; 3000]).len() + 2
        );
        assert_eq!(pg_json_len(&Type::TEXT, 100), 102);
    }

    #[test]
    fn sqlite_values_follow_declared_types() {
        use rusqlite::types::ValueRef as V;
        assert_eq!(sqlite_value(V::Integer(1), "BOOLEAN"), json!(true));
        assert_eq!(sqlite_value(V::Real(1.5), "NUMERIC(10,2)"), json!("1.5"));
        assert_eq!(sqlite_value(V::Text(b"{\"a\":1}"), "JSON"), json!({"a": 1}));
        assert_eq!(sqlite_value(V::Blob(b"hi"), "BLOB"), json!("aGk="));
        assert_eq!(
            sqlite_value(V::Integer(9_007_199_254_740_993), "BIGINT"),
            json!(9_007_199_254_740_993_i64)
        );
        assert_eq!(sqlite_value(V::Real(f64::NAN), ""), json!("NaN"));
    }
}
