//! The single pass over a document's raw text: its grammar (numbers by
//! grammar only, never converted) and every object's keys, compared
//! unescaped.

use std::collections::HashSet;

use serde::de;

use super::{StrictJsonError, strip_position};

/// Object and array nesting accepted at most (serde_json's limit).
const MAX_DEPTH: usize = 128;

/// A single pass over the raw text of a document: its grammar, and every
/// object's keys (compared unescaped).
pub(super) struct Walk<'a> {
    pub(super) text: &'a str,
    pub(super) at: usize,
}

impl Walk<'_> {
    pub(super) fn document(mut self) -> Result<(), StrictJsonError> {
        self.value("", 0)?;
        self.space();
        if self.at != self.text.len() {
            return Err(self.fail());
        }
        Ok(())
    }

    /// The error for a document that is not JSON: serde_json's own message
    /// (as before this walker existed), without its position.
    pub(super) fn invalid(bytes: &[u8]) -> StrictJsonError {
        let text = match serde_json::from_slice::<de::IgnoredAny>(bytes) {
            Err(err) => strip_position(&err.to_string()),
            Ok(_) => "not a single JSON document".to_owned(),
        };
        StrictJsonError {
            path: ".".to_owned(),
            message: format!("not valid JSON: {text}"),
        }
    }

    fn fail(&self) -> StrictJsonError {
        Walk::invalid(self.text.as_bytes())
    }

    fn peek(&self) -> Option<u8> {
        self.text.as_bytes().get(self.at).copied()
    }

    fn space(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.at += 1;
        }
    }

    fn eat(&mut self, byte: u8) -> Result<(), StrictJsonError> {
        if self.peek() == Some(byte) {
            self.at += 1;
            Ok(())
        } else {
            Err(self.fail())
        }
    }

    fn value(&mut self, path: &str, depth: usize) -> Result<(), StrictJsonError> {
        self.space();
        match self.peek() {
            Some(b'{') => self.object(path, depth + 1),
            Some(b'[') => self.array(path, depth + 1),
            Some(b'"') => self.string().map(drop),
            Some(b'-' | b'0'..=b'9') => self.number(),
            Some(b't') => self.literal("true"),
            Some(b'f') => self.literal("false"),
            Some(b'n') => self.literal("null"),
            _ => Err(self.fail()),
        }
    }

    fn object(&mut self, path: &str, depth: usize) -> Result<(), StrictJsonError> {
        if depth > MAX_DEPTH {
            return Err(self.fail());
        }
        self.eat(b'{')?;
        self.space();
        if self.peek() == Some(b'}') {
            self.at += 1;
            return Ok(());
        }
        let mut seen: HashSet<String> = HashSet::new();
        loop {
            self.space();
            let key = self.string()?;
            let inner = if path.is_empty() {
                key.clone()
            } else {
                format!("{path}.{key}")
            };
            if seen.contains(&key) {
                return Err(StrictJsonError {
                    path: if path.is_empty() {
                        ".".to_owned()
                    } else {
                        path.to_owned()
                    },
                    message: format!("duplicate key `{key}`"),
                });
            }
            self.space();
            self.eat(b':')?;
            self.value(&inner, depth)?;
            seen.insert(key);
            self.space();
            match self.peek() {
                Some(b',') => self.at += 1,
                Some(b'}') => {
                    self.at += 1;
                    return Ok(());
                }
                _ => return Err(self.fail()),
            }
        }
    }

    fn array(&mut self, path: &str, depth: usize) -> Result<(), StrictJsonError> {
        if depth > MAX_DEPTH {
            return Err(self.fail());
        }
        self.eat(b'[')?;
        self.space();
        if self.peek() == Some(b']') {
            self.at += 1;
            return Ok(());
        }
        let mut index = 0usize;
        loop {
            self.value(&format!("{path}[{index}]"), depth)?;
            index += 1;
            self.space();
            match self.peek() {
                Some(b',') => self.at += 1,
                Some(b']') => {
                    self.at += 1;
                    return Ok(());
                }
                _ => return Err(self.fail()),
            }
        }
    }

    /// A string, unescaped.
    fn string(&mut self) -> Result<String, StrictJsonError> {
        self.eat(b'"')?;
        let mut out = String::new();
        loop {
            let start = self.at;
            while let Some(b) = self.peek() {
                if b == b'"' || b == b'\\' || b < 0x20 {
                    break;
                }
                self.at += 1;
            }
            out.push_str(&self.text[start..self.at]);
            match self.peek() {
                Some(b'"') => {
                    self.at += 1;
                    return Ok(out);
                }
                Some(b'\\') => {
                    self.at += 1;
                    self.escape(&mut out)?;
                }
                _ => return Err(self.fail()),
            }
        }
    }

    fn escape(&mut self, out: &mut String) -> Result<(), StrictJsonError> {
        let Some(b) = self.peek() else {
            return Err(self.fail());
        };
        self.at += 1;
        let c = match b {
            b'"' => '"',
            b'\\' => '\\',
            b'/' => '/',
            b'b' => '\u{8}',
            b'f' => '\u{c}',
            b'n' => '\n',
            b'r' => '\r',
            b't' => '\t',
            b'u' => {
                let high = self.hex4()?;
                let code = if (0xd800..0xdc00).contains(&high)
                    && self.text[self.at..].starts_with("\\u")
                {
                    self.at += 2;
                    let low = self.hex4()?;
                    if !(0xdc00..0xe000).contains(&low) {
                        return Err(self.fail());
                    }
                    0x10000 + ((high - 0xd800) << 10) + (low - 0xdc00)
                } else {
                    high
                };
                // A lone surrogate has no character: kept as U+FFFD for the
                // key comparison (a value keeps its raw text anyway).
                char::from_u32(code).unwrap_or(char::REPLACEMENT_CHARACTER)
            }
            _ => return Err(self.fail()),
        };
        out.push(c);
        Ok(())
    }

    fn hex4(&mut self) -> Result<u32, StrictJsonError> {
        let digits = self
            .text
            .get(self.at..self.at + 4)
            .filter(|d| d.bytes().all(|b| b.is_ascii_hexdigit()))
            .ok_or_else(|| self.fail())?;
        self.at += 4;
        u32::from_str_radix(digits, 16).map_err(|_| self.fail())
    }

    /// `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`, not converted.
    fn number(&mut self) -> Result<(), StrictJsonError> {
        if self.peek() == Some(b'-') {
            self.at += 1;
        }
        match self.peek() {
            Some(b'0') => self.at += 1,
            Some(b'1'..=b'9') => self.digits(),
            _ => return Err(self.fail()),
        }
        if self.peek() == Some(b'.') {
            self.at += 1;
            self.some_digits()?;
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.at += 1;
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.at += 1;
            }
            self.some_digits()?;
        }
        Ok(())
    }

    fn digits(&mut self) {
        while matches!(self.peek(), Some(b'0'..=b'9')) {
            self.at += 1;
        }
    }

    fn some_digits(&mut self) -> Result<(), StrictJsonError> {
        let start = self.at;
        self.digits();
        if self.at == start {
            return Err(self.fail());
        }
        Ok(())
    }

    fn literal(&mut self, word: &str) -> Result<(), StrictJsonError> {
        if self.text[self.at..].starts_with(word) {
            self.at += word.len();
            Ok(())
        } else {
            Err(self.fail())
        }
    }
}
