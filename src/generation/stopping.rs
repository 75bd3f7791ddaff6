//! Stop strings: cut exactly where one begins, even across tokens, and hold back text
//! that might still become one so streamed deltas never need taking back.

/// The stop strings of one generation, applied to its growing text.
#[derive(Debug, Clone, Default)]
pub struct StopStrings {
    stops: Vec<String>,
    longest: usize,
}

/// What the text so far allows to be emitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopScan {
    /// A stop string begins at this byte: the text ends there.
    Stopped(usize),
    /// Text up to this byte is final; the rest may still begin a stop string.
    SafeUpTo(usize),
}

impl StopStrings {
    /// Stop strings; empty ones are ignored.
    pub fn new(stops: impl IntoIterator<Item = String>) -> Self {
        let stops: Vec<String> = stops.into_iter().filter(|s| !s.is_empty()).collect();
        let longest = stops.iter().map(String::len).max().unwrap_or(0);
        Self { stops, longest }
    }

    /// Whether there are no stop strings.
    pub fn is_empty(&self) -> bool {
        self.stops.is_empty()
    }

    /// Scans `text`, of which the first `checked` bytes were scanned before without a stop.
    pub fn scan(&self, text: &str, checked: usize) -> StopScan {
        if self.stops.is_empty() {
            return StopScan::SafeUpTo(text.len());
        }
        // A stop string ending in the new text starts at most `longest - 1` bytes before it.
        let mut from = checked.saturating_sub(self.longest.saturating_sub(1)).min(text.len());
        while !text.is_char_boundary(from) {
            from -= 1;
        }
        let first = self.stops.iter().filter_map(|s| text[from..].find(s.as_str()).map(|i| from + i)).min();
        if let Some(at) = first {
            return StopScan::Stopped(at);
        }
        // Hold back the longest tail that is a proper prefix of some stop string.
        let mut safe = text.len();
        for s in &self.stops {
            for k in (1..s.len()).rev() {
                if k <= text.len() && s.is_char_boundary(k) && text.ends_with(&s[..k]) {
                    safe = safe.min(text.len() - k);
                    break;
                }
            }
        }
        StopScan::SafeUpTo(safe)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_a_stop_spanning_pieces() {
        let s = StopStrings::new(["END".to_string()]);
        assert_eq!(s.scan("abc E", 0), StopScan::SafeUpTo(4));
        assert_eq!(s.scan("abc EN", 5), StopScan::SafeUpTo(4));
        assert_eq!(s.scan("abc ENDx", 6), StopScan::Stopped(4));
    }

    #[test]
    fn earliest_stop_wins_and_unicode_is_respected() {
        let s = StopStrings::new(["é!".to_string(), "b".to_string()]);
        assert_eq!(s.scan("aé!b", 0), StopScan::Stopped(1));
        assert_eq!(s.scan("xé", 0), StopScan::SafeUpTo(1));
        assert_eq!(StopStrings::new([]).scan("anything", 0), StopScan::SafeUpTo(8));
    }
}
