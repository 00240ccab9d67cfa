//! Log-linear latency buckets (HDR-style): 16 linear buckets of 128 ns
//! below 2 µs, then 8 buckets per power of two up to ~17 s. A latency
//! is reported as its bucket's midpoint, within 6.4 % of the true value
//! from 1 µs to 16 s (the widest bucket relative to its values is the one
//! holding 1 µs: 128 ns wide). Everything slower counts in the last bucket.
//!
//! Histograms are stored sparse (`Sparse`: the buckets that counted
//! something), since a second of one client's I/O rarely spans more than
//! a few dozen of the 200 buckets.

use serde::Serialize;

/// Buckets in the scheme.
pub const BUCKETS: usize = 200;
/// Width of the linear buckets (and the unit of the others), as a shift of nanoseconds.
const UNIT_SHIFT: u32 = 7;
/// Linear buckets below the first power-of-two group.
const LINEAR: u64 = 16;
/// Buckets per power of two, as a shift.
const SUB_SHIFT: u32 = 3;

/// The bucket that counts a latency of `ns` nanoseconds.
pub fn bucket_of(ns: u64) -> usize {
    let units = ns >> UNIT_SHIFT;
    if units < LINEAR {
        return units as usize;
    }
    let octave = 63 - units.leading_zeros(); // >= 4
    let sub = (units >> (octave - SUB_SHIFT)) & ((1 << SUB_SHIFT) - 1);
    let index = LINEAR as usize + (octave as usize - 4) * (1 << SUB_SHIFT) + sub as usize;
    index.min(BUCKETS - 1)
}

/// The smallest latency (ns) bucket `index` counts.
pub fn lower_ns(index: usize) -> u64 {
    let index = index as u64;
    if index < LINEAR {
        return index << UNIT_SHIFT;
    }
    let octave = (index - LINEAR) / (1 << SUB_SHIFT) + 4;
    let sub = (index - LINEAR) % (1 << SUB_SHIFT);
    ((1u64 << SUB_SHIFT) + sub) << (octave - SUB_SHIFT as u64) << UNIT_SHIFT
}

/// The end (exclusive, ns) of bucket `index` (the last bucket also counts
/// everything above it).
pub fn upper_ns(index: usize) -> u64 {
    lower_ns(index + 1)
}

/// The latency (ns) a bucket stands for: its midpoint.
pub fn value_ns(index: usize) -> u64 {
    (lower_ns(index) + upper_ns(index)) / 2
}

/// A histogram with only its non-zero buckets, sorted by bucket.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Sparse(pub Vec<(u8, u32)>);

impl Sparse {
    /// From dense counts (one per bucket).
    pub fn from_dense(counts: impl IntoIterator<Item = u64>) -> Self {
        Sparse(
            counts
                .into_iter()
                .enumerate()
                .filter(|(_, c)| *c > 0)
                .map(|(i, c)| (i as u8, c.min(u32::MAX as u64) as u32))
                .collect(),
        )
    }

    pub fn total(&self) -> u64 {
        self.0.iter().map(|(_, c)| *c as u64).sum()
    }

    /// Adds `other` into this one.
    pub fn merge(&mut self, other: &Sparse) {
        if other.0.is_empty() {
            return;
        }
        if self.0.is_empty() {
            self.0.clone_from(&other.0);
            return;
        }
        let mut out = Vec::with_capacity(self.0.len().max(other.0.len()));
        let (mut a, mut b) = (self.0.iter().peekable(), other.0.iter().peekable());
        loop {
            match (a.peek(), b.peek()) {
                (Some(x), Some(y)) if x.0 == y.0 => {
                    out.push((x.0, x.1.saturating_add(y.1)));
                    a.next();
                    b.next();
                }
                (Some(x), Some(y)) if x.0 < y.0 => {
                    out.push(**x);
                    a.next();
                }
                (Some(_), Some(y)) => {
                    out.push(**y);
                    b.next();
                }
                (Some(x), None) => {
                    out.push(**x);
                    a.next();
                }
                (None, Some(y)) => {
                    out.push(**y);
                    b.next();
                }
                (None, None) => break,
            }
        }
        self.0 = out;
    }

    /// Only the buckets whose midpoint lies in `[min_ns, max_ns]`.
    pub fn band(&self, min_ns: u64, max_ns: u64) -> Sparse {
        Sparse(
            self.0
                .iter()
                .filter(|(i, _)| (min_ns..=max_ns).contains(&value_ns(*i as usize)))
                .copied()
                .collect(),
        )
    }

    /// The latency (ns) at quantile `q` (0 < q <= 1): the midpoint of the
    /// bucket holding the `ceil(q * total)`-th smallest value. None if empty.
    pub fn quantile(&self, q: f64) -> Option<u64> {
        let total = self.total();
        if total == 0 {
            return None;
        }
        let rank = ((q * total as f64).ceil() as u64).clamp(1, total);
        let mut seen = 0;
        for (index, count) in &self.0 {
            seen += *count as u64;
            if seen >= rank {
                return Some(value_ns(*index as usize));
            }
        }
        self.0.last().map(|(i, _)| value_ns(*i as usize))
    }

    /// Heap bytes this histogram holds.
    pub fn heap_bytes(&self) -> usize {
        self.0.capacity() * std::mem::size_of::<(u8, u32)>()
    }
}

/// Several histograms packed for keeping: per histogram its number of
/// buckets, then per bucket the distance from the previous bucket and the
/// count, each a LEB128 varint (two or three bytes a bucket instead of
/// the eight of a `(u8, u32)`; what an hour of history is made of).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Packed(Box<[u8]>);

fn put_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push(value as u8 | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

fn get_varint(bytes: &[u8], at: &mut usize) -> u64 {
    let mut value = 0u64;
    let mut shift = 0;
    while let Some(&byte) = bytes.get(*at) {
        *at += 1;
        value |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 || shift >= 63 {
            break;
        }
        shift += 7;
    }
    value
}

impl Packed {
    pub fn new(hists: &[&Sparse]) -> Packed {
        let mut out = Vec::new();
        for hist in hists {
            put_varint(&mut out, hist.0.len() as u64);
            let mut previous = 0;
            for (index, count) in &hist.0 {
                put_varint(&mut out, u64::from(*index - previous));
                put_varint(&mut out, u64::from(*count));
                previous = *index;
            }
        }
        Packed(out.into_boxed_slice())
    }

    /// Histogram `which` (in the order given to [`Packed::new`]; empty if
    /// there are fewer).
    pub fn get(&self, which: usize) -> Sparse {
        let mut at = 0;
        for current in 0..=which {
            let len = get_varint(&self.0, &mut at) as usize;
            if current == which {
                let mut hist = Vec::with_capacity(len.min(BUCKETS));
                let mut index = 0u64;
                for _ in 0..len {
                    index += get_varint(&self.0, &mut at);
                    let count = get_varint(&self.0, &mut at);
                    hist.push((index.min(BUCKETS as u64 - 1) as u8, count.min(u32::MAX as u64) as u32));
                }
                return Sparse(hist);
            }
            for _ in 0..2 * len {
                get_varint(&self.0, &mut at);
            }
        }
        Sparse::default()
    }

    pub fn heap_bytes(&self) -> usize {
        self.0.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn packed_histograms_come_back_whole() {
        let a = Sparse(vec![(0, 1), (7, 300), (199, u32::MAX)]);
        let b = Sparse::default();
        let c = Sparse(vec![(16, 70_000)]);
        let packed = Packed::new(&[&a, &b, &c]);
        assert_eq!((packed.get(0), packed.get(1), packed.get(2)), (a, b, c));
        assert_eq!(packed.get(3), Sparse::default());
        assert!(packed.heap_bytes() < 20);
    }

    #[test]
    fn buckets_tile_the_range_in_order() {
        assert_eq!(lower_ns(0), 0);
        for index in 0..BUCKETS - 1 {
            assert!(lower_ns(index) < upper_ns(index), "bucket {index}");
            assert_eq!(bucket_of(lower_ns(index)), index);
            assert_eq!(bucket_of(upper_ns(index) - 1), index);
        }
        assert_eq!(bucket_of(u64::MAX), BUCKETS - 1);
        // The scheme covers 1 µs .. 16 s.
        assert!(upper_ns(BUCKETS - 2) > 16_000_000_000);
        assert_eq!(bucket_of(1_000), 7);
        assert_eq!(lower_ns(16), 2_048);
    }

    #[test]
    fn midpoints_are_within_the_stated_error_from_1_us_to_16_s() {
        for index in bucket_of(1_000)..BUCKETS - 1 {
            let (lo, hi, mid) = (lower_ns(index).max(1_000), upper_ns(index) - 1, value_ns(index));
            for value in [lo, hi] {
                let error = (mid as f64 - value as f64).abs() / value as f64;
                assert!(
                    error <= 0.064,
                    "bucket {index}: {value} ns reported as {mid} ns ({error})"
                );
            }
        }
    }

    #[test]
    fn merge_adds_counts_bucket_by_bucket() {
        let mut a = Sparse(vec![(1, 2), (5, 1)]);
        a.merge(&Sparse(vec![(0, 1), (5, 3), (9, 4)]));
        assert_eq!(a, Sparse(vec![(0, 1), (1, 2), (5, 4), (9, 4)]));
        a.merge(&Sparse::default());
        assert_eq!(a.total(), 11);
    }

    proptest! {
        #[test]
        fn quantiles_are_within_the_stated_error(
            values in proptest::collection::vec(1_000u64..16_000_000_000, 1..400),
            q in 0.01f64..=1.0,
        ) {
            let mut dense = vec![0u64; BUCKETS];
            for v in &values {
                dense[bucket_of(*v)] += 1;
            }
            let hist = Sparse::from_dense(dense);
            let mut sorted = values.clone();
            sorted.sort_unstable();
            let rank = ((q * values.len() as f64).ceil() as usize).clamp(1, values.len());
            let exact = sorted[rank - 1];
            let estimate = hist.quantile(q).unwrap();
            let error = (estimate as f64 - exact as f64).abs() / exact as f64;
            prop_assert!(error <= 0.064, "q {} exact {} estimate {}", q, exact, estimate);
        }

        #[test]
        fn merging_equals_recording_together(
            a in proptest::collection::vec(0u64..20_000_000_000, 0..200),
            b in proptest::collection::vec(0u64..20_000_000_000, 0..200),
        ) {
            let dense = |values: &[u64]| {
                let mut d = vec![0u64; BUCKETS];
                for v in values {
                    d[bucket_of(*v)] += 1;
                }
                Sparse::from_dense(d)
            };
            let mut merged = dense(&a);
            merged.merge(&dense(&b));
            let together: Vec<u64> = a.iter().chain(&b).copied().collect();
            prop_assert_eq!(merged, dense(&together));
        }
    }
}
