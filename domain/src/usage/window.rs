//! Times in microseconds (the resolution of the log's `recorded_at`) and epoch-aligned windows.

use chrono::{DateTime, Utc};

/// Microseconds since the Unix epoch.
pub type Micros = i64;

/// `t` in microseconds since the epoch.
pub fn micros(t: DateTime<Utc>) -> Micros {
    t.timestamp_micros()
}

/// The time `us` microseconds after the epoch.
pub fn at(us: Micros) -> DateTime<Utc> {
    DateTime::from_timestamp_micros(us).unwrap_or(DateTime::<Utc>::MIN_UTC)
}

/// Windows of one length aligned to the epoch: `[k·length, (k+1)·length)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Windows {
    length: Micros,
}

impl Windows {
    /// Windows `length` microseconds long; `None` unless positive.
    pub fn new(length: Micros) -> Option<Windows> {
        (length > 0).then_some(Windows { length })
    }

    /// Windows of `seconds` (`[timings] usage_window`), rounded to whole microseconds.
    pub fn from_seconds(seconds: f64) -> Option<Windows> {
        let us = (seconds * 1e6).round();
        (us.is_finite() && us >= 1.0 && us < i64::MAX as f64)
            .then(|| Windows::new(us as Micros))
            .flatten()
    }

    /// The length in microseconds.
    pub fn length(&self) -> Micros {
        self.length
    }

    /// The start of the window that holds `t`.
    pub fn start_of(&self, t: Micros) -> Micros {
        t.div_euclid(self.length) * self.length
    }

    /// `[from, to)` cut at every window boundary inside it, in order (nothing when empty).
    pub fn pieces(&self, from: Micros, to: Micros) -> impl Iterator<Item = (Micros, Micros)> {
        let length = self.length;
        let mut start = from;
        std::iter::from_fn(move || {
            if start >= to {
                return None;
            }
            let boundary = start.div_euclid(length) * length + length;
            let piece = (start, boundary.min(to));
            start = piece.1;
            Some(piece)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_align_to_the_epoch_and_cut_a_span_at_their_boundaries() {
        let w = Windows::new(300).unwrap();
        assert_eq!(w.start_of(299), 0);
        assert_eq!(w.start_of(300), 300);
        assert_eq!(w.start_of(-1), -300);
        let pieces: Vec<_> = w.pieces(250, 950).collect();
        assert_eq!(pieces, vec![(250, 300), (300, 600), (600, 900), (900, 950)]);
        assert_eq!(w.pieces(600, 600).count(), 0);
    }

    #[test]
    fn a_window_in_seconds_becomes_whole_microseconds() {
        assert_eq!(Windows::from_seconds(300.0).unwrap().length(), 300_000_000);
        assert_eq!(Windows::from_seconds(0.5).unwrap().length(), 500_000);
        assert!(Windows::from_seconds(0.0).is_none());
        assert!(Windows::from_seconds(f64::NAN).is_none());
    }
}
