//! The binary records ranks exchange about a step (feature `mpi`): little-endian numbers,
//! length-prefixed strings and lists, read back in the order written. A record that ends
//! early reads as an error naming what was missing, never as a default.

/// Builds a record.
#[derive(Default)]
pub(crate) struct Writer(pub Vec<u8>);

impl Writer {
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn f64(&mut self, v: f64) -> &mut Self {
        self.u64(v.to_bits())
    }
    pub fn str(&mut self, s: &str) -> &mut Self {
        self.u64(s.len() as u64);
        self.0.extend_from_slice(s.as_bytes());
        self
    }
    pub fn f32s(&mut self, v: &[f32]) -> &mut Self {
        self.u64(v.len() as u64);
        for x in v {
            self.0.extend_from_slice(&x.to_le_bytes());
        }
        self
    }
    pub fn usizes(&mut self, v: &[usize]) -> &mut Self {
        self.u64(v.len() as u64);
        for &x in v {
            self.u64(x as u64);
        }
        self
    }
}

/// Reads a record.
pub(crate) struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    pub fn new(bytes: &'a [u8]) -> Reader<'a> {
        Reader { bytes, at: 0 }
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], String> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len());
        let Some(end) = end else {
            return Err(format!(
                "a record of {} bytes ends before its {what} (at byte {}, {n} more needed)",
                self.bytes.len(),
                self.at
            ));
        };
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }
    pub fn u8(&mut self, what: &str) -> Result<u8, String> {
        Ok(self.take(1, what)?[0])
    }
    pub fn u64(&mut self, what: &str) -> Result<u64, String> {
        Ok(u64::from_le_bytes(
            self.take(8, what)?.try_into().expect("8 bytes"),
        ))
    }
    pub fn f64(&mut self, what: &str) -> Result<f64, String> {
        Ok(f64::from_bits(self.u64(what)?))
    }
    pub fn str(&mut self, what: &str) -> Result<String, String> {
        let n = self.u64(what)? as usize;
        Ok(String::from_utf8_lossy(self.take(n, what)?).into_owned())
    }
    pub fn f32s(&mut self, what: &str) -> Result<Vec<f32>, String> {
        let n = self.u64(what)? as usize;
        let bytes = self.take(n.saturating_mul(4), what)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect())
    }
    pub fn usizes(&mut self, what: &str) -> Result<Vec<usize>, String> {
        let n = self.u64(what)? as usize;
        let bytes = self.take(n.saturating_mul(8), what)?;
        Ok(bytes
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")) as usize)
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_reads_back_what_was_written_and_names_what_is_missing() {
        let mut w = Writer::default();
        w.u8(3)
            .u64(1 << 40)
            .f64(-0.1)
            .f64(f64::NAN)
            .str("rank 2: stage 1")
            .f32s(&[1.5, -0.0])
            .usizes(&[7, 0]);
        let mut r = Reader::new(&w.0);
        assert_eq!(r.u8("a").unwrap(), 3);
        assert_eq!(r.u64("b").unwrap(), 1 << 40);
        assert_eq!(r.f64("c").unwrap(), -0.1);
        assert!(r.f64("d").unwrap().is_nan());
        assert_eq!(r.str("e").unwrap(), "rank 2: stage 1");
        let v = r.f32s("f").unwrap();
        assert_eq!((v[0], v[1].to_bits()), (1.5, (-0.0f32).to_bits()));
        assert_eq!(r.usizes("g").unwrap(), vec![7, 0]);
        let e = r.u64("the loss").unwrap_err();
        assert!(e.contains("before its the loss"), "{e}");
        let mut short = Reader::new(&w.0[..5]);
        short.u8("a").unwrap();
        assert!(short.u64("step").unwrap_err().contains("step"));
    }
}
