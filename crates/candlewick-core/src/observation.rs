//! Named observation points: what to observe, and the host values observed.

use std::collections::BTreeMap;

/// Why an observation request or set is invalid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ObservationError {
    /// A selector or path was the empty string.
    #[error("observation path must not be empty")]
    EmptyPath,
    /// A path was inserted twice into one set.
    #[error("observation path `{0}` is already in the set")]
    DuplicatePath(String),
    /// A tensor's data length does not equal the product of its shape.
    #[error("observation `{path}`: shape {shape:?} needs {expected} values, got {actual}")]
    ShapeMismatch {
        /// The offending path.
        path: String,
        /// The declared shape.
        shape: Vec<usize>,
        /// The number of values the shape implies.
        expected: usize,
        /// The number of values given.
        actual: usize,
    },
    /// A sparse value's offsets, indices and values do not describe `rows` rows of `width` columns.
    #[error("observation `{path}`: the sparse value is not {rows} rows of {width} columns (offsets, indices and values disagree)")]
    BadSparse {
        /// The offending path.
        path: String,
        /// The declared rows.
        rows: usize,
        /// The declared width.
        width: usize,
    },
    /// A selector matches no point this model offers.
    #[error("the model has no observation point matching `{selector}` (see observation_points())")]
    UnknownPoint {
        /// The selector as written.
        selector: String,
    },
}

/// One selector: an exact path, or a prefix matching whole dotted segments.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ObservationSelector {
    /// Matches exactly this path.
    Exact(String),
    /// Matches this path and every path below it (`a.b` matches `a.b.c`, not `a.bc`).
    Prefix(String),
}

impl ObservationSelector {
    /// A selector for exactly `path`.
    pub fn exact(path: impl Into<String>) -> Self {
        Self::Exact(path.into())
    }

    /// A selector for `prefix` and everything below it.
    pub fn prefix(prefix: impl Into<String>) -> Self {
        Self::Prefix(prefix.into())
    }

    /// The selector's text.
    pub fn as_str(&self) -> &str {
        match self {
            Self::Exact(p) | Self::Prefix(p) => p,
        }
    }

    /// Whether `path` is selected.
    pub fn matches(&self, path: &str) -> bool {
        match self {
            Self::Exact(p) => p == path,
            Self::Prefix(p) => {
                path.strip_prefix(p.as_str()).is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
            }
        }
    }
}

/// A set of selectors; empty means "every point".
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ObservationRequest {
    selectors: Vec<ObservationSelector>,
    select_all: bool,
}

impl ObservationRequest {
    /// Every observation point the model offers.
    pub fn all() -> Self {
        Self { selectors: Vec::new(), select_all: true }
    }

    /// Exactly the points the selectors match; no selector selects nothing.
    pub fn select(selectors: impl IntoIterator<Item = ObservationSelector>) -> Result<Self, ObservationError> {
        let selectors: Vec<_> = selectors.into_iter().collect();
        if selectors.iter().any(|s| s.as_str().is_empty()) {
            return Err(ObservationError::EmptyPath);
        }
        // An empty list is the contract's "everything" only through `all()`/`from_selectors`.
        Ok(Self { selectors, select_all: false })
    }

    /// DESIGN §2's reading: an empty list of selectors means everything.
    pub fn from_selectors(selectors: impl IntoIterator<Item = ObservationSelector>) -> Result<Self, ObservationError> {
        let mut req = Self::select(selectors)?;
        req.select_all = req.selectors.is_empty();
        Ok(req)
    }

    /// The selectors, empty when everything is selected.
    pub fn selectors(&self) -> &[ObservationSelector] {
        &self.selectors
    }

    /// Whether this request selects every point.
    pub fn is_all(&self) -> bool {
        self.select_all
    }

    /// Whether this request selects nothing at all.
    pub fn is_empty(&self) -> bool {
        !self.select_all && self.selectors.is_empty()
    }

    /// Whether `path` is selected.
    pub fn matches(&self, path: &str) -> bool {
        self.select_all || self.selectors.iter().any(|s| s.matches(path))
    }

    /// Whether a named point is selected (its name is only formatted when a selector must look at it).
    pub fn matches_point(&self, point: crate::points::Point) -> bool {
        self.select_all || (!self.selectors.is_empty() && self.matches(&point.to_string()))
    }

    /// Checks every selector against the points a model offers; an unmatched one is an error.
    pub fn validate<'a>(&self, available: impl IntoIterator<Item = &'a str> + Clone) -> Result<(), ObservationError> {
        for sel in &self.selectors {
            if !available.clone().into_iter().any(|p| sel.matches(p)) {
                return Err(ObservationError::UnknownPoint { selector: sel.as_str().to_owned() });
            }
        }
        Ok(())
    }
}

/// One observed value, on the host.
#[derive(Debug, Clone, PartialEq)]
pub enum ObservationValue {
    /// A float32 tensor in row-major order.
    Tensor {
        /// Dimensions, outermost first.
        shape: Vec<usize>,
        /// Row-major values; `shape.iter().product()` of them.
        data: Vec<f32>,
    },
    /// Sparse rows `[rows, width]` (an SAE's features): row `r` holds the columns
    /// `indices[offsets[r]..offsets[r + 1]]` with those `values`, every other column 0.
    Sparse {
        /// Number of rows (positions).
        rows: usize,
        /// Number of columns (the SAE's width).
        width: usize,
        /// `rows + 1` offsets into `indices` and `values`, the first 0.
        offsets: Vec<usize>,
        /// Column of each stored value, ascending within a row.
        indices: Vec<u32>,
        /// The stored values.
        values: Vec<f32>,
    },
    /// An integer scalar.
    Int(i64),
    /// A floating-point scalar.
    Float(f64),
    /// A boolean scalar.
    Bool(bool),
    /// A text scalar.
    Text(String),
}

/// Observed values keyed by path, in path order; paths are unique and non-empty.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ObservationSet {
    values: BTreeMap<String, ObservationValue>,
}

impl ObservationSet {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one value, refusing empty or duplicate paths and tensors whose data does not fit their shape.
    pub fn insert(&mut self, path: impl Into<String>, value: ObservationValue) -> Result<(), ObservationError> {
        let path = path.into();
        if path.is_empty() {
            return Err(ObservationError::EmptyPath);
        }
        if let ObservationValue::Tensor { shape, data } = &value {
            let expected: usize = shape.iter().product();
            if expected != data.len() {
                return Err(ObservationError::ShapeMismatch {
                    path,
                    shape: shape.clone(),
                    expected,
                    actual: data.len(),
                });
            }
        }
        if let ObservationValue::Sparse { rows, width, offsets, indices, values } = &value {
            let fits = offsets.len() == rows + 1
                && offsets.first() == Some(&0)
                && offsets.windows(2).all(|w| w[0] <= w[1])
                && offsets.last() == Some(&indices.len())
                && indices.len() == values.len()
                && indices.iter().all(|&i| (i as usize) < *width);
            if !fits {
                return Err(ObservationError::BadSparse { path, rows: *rows, width: *width });
            }
        }
        if self.values.contains_key(&path) {
            return Err(ObservationError::DuplicatePath(path));
        }
        self.values.insert(path, value);
        Ok(())
    }

    /// The value at `path`.
    pub fn get(&self, path: &str) -> Option<&ObservationValue> {
        self.values.get(path)
    }

    /// Number of values.
    pub fn len(&self) -> usize {
        self.values.len()
    }

    /// Whether the set holds nothing.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// Paths and values in path order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &ObservationValue)> {
        self.values.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Consumes the set into its entries.
    pub fn into_entries(self) -> impl Iterator<Item = (String, ObservationValue)> {
        self.values.into_iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_matches_whole_segments() {
        let s = ObservationSelector::prefix("model.layers.2");
        assert!(s.matches("model.layers.2"));
        assert!(s.matches("model.layers.2.output"));
        assert!(s.matches("model.layers.2.attention.pattern"));
        assert!(!s.matches("model.layers.20.output"));
        assert!(!s.matches("model.layers.21"));
        assert!(!s.matches("model.layers"));
    }

    #[test]
    fn exact_matches_only_itself() {
        let s = ObservationSelector::exact("model.logits");
        assert!(s.matches("model.logits"));
        assert!(!s.matches("model.logits.x"));
    }

    #[test]
    fn empty_selection_selects_nothing_and_all_selects_everything() {
        let none = ObservationRequest::select(Vec::new()).unwrap();
        assert!(none.is_empty());
        assert!(!none.matches("model.logits"));
        assert!(ObservationRequest::all().matches("model.layers.0.output"));
        assert!(ObservationRequest::from_selectors(Vec::new()).unwrap().is_all());
    }

    #[test]
    fn unknown_selector_is_an_error() {
        let req = ObservationRequest::select([ObservationSelector::prefix("model.layers.9")]).unwrap();
        let points = ["model.layers.1.output", "model.logits"];
        assert_eq!(
            req.validate(points.iter().copied()),
            Err(ObservationError::UnknownPoint { selector: "model.layers.9".into() })
        );
        assert!(ObservationRequest::select([ObservationSelector::exact("")]).is_err());
    }

    #[test]
    fn set_rejects_empty_duplicate_and_misshapen() {
        let mut set = ObservationSet::new();
        let t = |n| ObservationValue::Tensor { shape: vec![2, 2], data: vec![0.0; n] };
        assert_eq!(set.insert("", t(4)), Err(ObservationError::EmptyPath));
        set.insert("a", t(4)).unwrap();
        assert_eq!(set.insert("a", t(4)), Err(ObservationError::DuplicatePath("a".into())));
        assert!(matches!(set.insert("b", t(3)), Err(ObservationError::ShapeMismatch { expected: 4, actual: 3, .. })));
        set.insert("c", ObservationValue::Int(3)).unwrap();
        assert_eq!(set.len(), 2);
        let sparse = |offsets: Vec<usize>, indices: Vec<u32>| ObservationValue::Sparse {
            rows: 2,
            width: 4,
            values: vec![1.0; indices.len()],
            offsets,
            indices,
        };
        set.insert("s", sparse(vec![0, 1, 2], vec![3, 0])).unwrap();
        assert!(matches!(set.insert("t", sparse(vec![0, 1], vec![3])), Err(ObservationError::BadSparse { .. })));
        assert!(matches!(set.insert("u", sparse(vec![0, 1, 2], vec![4, 0])), Err(ObservationError::BadSparse { .. })));
    }
}
