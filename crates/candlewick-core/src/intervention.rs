//! Interventions as data (docs/interventions.md): an edit names a point and an operation, and
//! the decoder applies it where it records that point, so the rest of the pass sees the edit.

use std::sync::Arc;

use crate::points::{LayerPoint, Point};

/// Why an intervention cannot be applied; nothing of a rejected list is applied.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InterventionError {
    /// The point names nothing this model has.
    #[error("intervention on `{point}`: the model has no such point (see observation_points())")]
    UnknownPoint {
        /// The point as given.
        point: String,
    },
    /// The point can be observed but not edited.
    #[error("intervention on `{point}`: this point can be observed but not edited")]
    NotEditable {
        /// The point as given.
        point: String,
    },
    /// A vector, direction or values array has the wrong number of elements.
    #[error("intervention `{op}` on `{point}`: {what} has {got} values, expected {expected}")]
    WrongSize {
        /// The point.
        point: String,
        /// The operation.
        op: &'static str,
        /// Which argument.
        what: &'static str,
        /// What was given.
        got: usize,
        /// What fits the point (alternatives joined by "or").
        expected: String,
    },
    /// A unit index (or an SAE's feature) is past the point's units.
    #[error("intervention on `{point}`: index {index} is out of range (it has {units} units)")]
    IndexOutOfRange {
        /// The point.
        point: String,
        /// The offending index.
        index: usize,
        /// How many units the point has.
        units: usize,
    },
    /// A position is past the session's context.
    #[error("intervention `{op}` on `{point}`: position {position} is past the context of {max_context} tokens")]
    PositionOutOfRange {
        /// The point.
        point: String,
        /// The operation.
        op: &'static str,
        /// The offending position.
        position: usize,
        /// The session's context size.
        max_context: usize,
    },
    /// A feature edit names an SAE that is not attached.
    #[error("intervention on `sae.{name}`: no SAE called `{name}` is attached (attached: {attached})")]
    UnknownSae {
        /// The SAE's name as given.
        name: String,
        /// The names attached, joined.
        attached: String,
    },
    /// A number is not finite, a direction is zero, or a required argument is missing.
    #[error("intervention `{op}` on `{point}`: {reason}")]
    Invalid {
        /// The point.
        point: String,
        /// The operation.
        op: &'static str,
        /// What is wrong.
        reason: String,
    },
}

/// What an edit does to the values at its point.
#[derive(Debug, Clone, PartialEq)]
pub enum EditOp {
    /// `x + scale · v`; `v` has the point's last dimension or its whole per-position shape.
    Add {
        /// The steering vector.
        vector: Vec<f32>,
        /// Its multiplier.
        scale: f32,
    },
    /// `x[positions] = values`, one row of the per-position shape for each listed position.
    Set {
        /// The rows, in the order of `positions`.
        values: Vec<f32>,
    },
    /// The listed units (heads, neurons, channels: the point's second dimension) times `factor`.
    Scale {
        /// The units.
        index: Vec<usize>,
        /// The factor; 0 ablates.
        factor: f32,
    },
    /// `x − (x · d̂) d̂` along the last dimension, with `d̂ = d / |d|`.
    ProjectOut {
        /// The direction (need not be normalised).
        direction: Vec<f32>,
    },
    /// An edit of an attached SAE's features, applied at the SAE's point (DESIGN §15).
    Sae {
        /// The attached SAE's name.
        sae: String,
        /// What to do to its features.
        edit: SaeEdit,
    },
}

/// What a feature edit does; `f` are the SAE's features of the point's value, `W_dec` its decoder.
#[derive(Debug, Clone, PartialEq)]
pub enum SaeEdit {
    /// `x + scale · W_dec[feature]` (the decoder row as stored, before any de-normalisation).
    Steer {
        /// The feature.
        feature: usize,
        /// Its multiplier.
        scale: f32,
    },
    /// The listed features set to `value`: `x + (f' − f) W_dec`, the SAE's error kept (0 ablates).
    Clamp {
        /// The features.
        features: Vec<usize>,
        /// Their new value.
        value: f32,
    },
    /// The point replaced by the reconstruction, plus the error where `keep_error`.
    Splice {
        /// Whether the error term is added back (then only the SAE's rounding changes the value).
        keep_error: bool,
    },
}

impl SaeEdit {
    /// The edit's name as `candlewick.interventions` spells it.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Steer { .. } => "sae_steer",
            Self::Clamp { value, .. } if *value == 0.0 => "sae_ablate",
            Self::Clamp { .. } => "sae_clamp",
            Self::Splice { .. } => "sae_splice",
        }
    }
}

impl EditOp {
    /// The operation's name as the APIs spell it.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Add { .. } => "add",
            Self::Set { .. } => "set",
            Self::Scale { .. } => "scale",
            Self::ProjectOut { .. } => "project_out",
            Self::Sae { edit, .. } => edit.name(),
        }
    }
}

/// One edit: a point, an operation, and the absolute positions it applies to.
#[derive(Debug, Clone, PartialEq)]
pub struct Intervention {
    /// The point's dotted name.
    pub point: String,
    /// What to do there.
    pub op: EditOp,
    /// Absolute sequence positions; `None` means every position, decoded ones included.
    pub positions: Option<Vec<usize>>,
}

/// A validated list of edits, each resolved to its point; cheap to clone and share.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct InterventionSet {
    edits: Arc<Vec<(Point, Intervention)>>,
}

/// The per-position shape of a point (`[H]`, `[heads, head_dim]`, `[intermediate]`, `[V]`).
pub type PointShape = Vec<usize>;

impl InterventionSet {
    /// No edits: the plain forward pass.
    pub fn empty() -> Self {
        Self::default()
    }

    /// Validates every edit against the model's points and context; all or nothing.
    ///
    /// `shape_of` answers the per-position shape of an editable point the model has, or `None`.
    pub fn new(
        edits: Vec<Intervention>,
        shape_of: impl Fn(Point) -> Option<PointShape>,
        max_context: usize,
    ) -> Result<Self, InterventionError> {
        Self::with_saes(edits, shape_of, &[], max_context)
    }

    /// As `new`, where a feature edit resolves to the point and width of the SAE it names in
    /// `saes` (`(name, point, d_sae)` of each attached SAE).
    pub fn with_saes(
        edits: Vec<Intervention>,
        shape_of: impl Fn(Point) -> Option<PointShape>,
        saes: &[(String, Point, usize)],
        max_context: usize,
    ) -> Result<Self, InterventionError> {
        let mut resolved = Vec::with_capacity(edits.len());
        for e in edits {
            if let EditOp::Sae { sae, edit } = &e.op {
                let Some((_, point, width)) = saes.iter().find(|(n, _, _)| n == sae) else {
                    let attached = saes.iter().map(|(n, _, _)| n.as_str()).collect::<Vec<_>>().join(", ");
                    let attached = if attached.is_empty() { "none".into() } else { attached };
                    return Err(InterventionError::UnknownSae { name: sae.clone(), attached });
                };
                validate_sae(&e, edit, *width, max_context)?;
                resolved.push((*point, e));
                continue;
            }
            let point =
                Point::parse(&e.point).ok_or_else(|| InterventionError::UnknownPoint { point: e.point.clone() })?;
            if matches!(point, Point::Layer(_, LayerPoint::AttentionPattern)) {
                return Err(InterventionError::NotEditable { point: e.point.clone() });
            }
            let shape = shape_of(point).ok_or_else(|| InterventionError::UnknownPoint { point: e.point.clone() })?;
            validate(&e, &shape, max_context)?;
            resolved.push((point, e));
        }
        Ok(Self { edits: Arc::new(resolved) })
    }

    /// Whether there is no edit.
    pub fn is_empty(&self) -> bool {
        self.edits.is_empty()
    }

    /// The edits with their resolved points, in application order.
    pub fn iter(&self) -> impl Iterator<Item = &(Point, Intervention)> {
        self.edits.iter()
    }

    /// The edits as given.
    pub fn interventions(&self) -> Vec<Intervention> {
        self.edits.iter().map(|(_, e)| e.clone()).collect()
    }

    /// These edits followed by `other`'s (a call's edits on top of the kept ones).
    pub fn then(&self, other: &InterventionSet) -> InterventionSet {
        if other.is_empty() {
            return self.clone();
        }
        if self.is_empty() {
            return other.clone();
        }
        let mut all = (*self.edits).clone();
        all.extend(other.edits.iter().cloned());
        Self { edits: Arc::new(all) }
    }

    /// Whether any edit applies at `point`.
    pub fn touches(&self, point: Point) -> bool {
        self.edits.iter().any(|(p, _)| *p == point)
    }
}

fn validate_sae(e: &Intervention, edit: &SaeEdit, width: usize, max_context: usize) -> Result<(), InterventionError> {
    let op = edit.name();
    if let Some(&p) = e.positions.iter().flatten().find(|&&p| p >= max_context) {
        return Err(InterventionError::PositionOutOfRange { point: e.point.clone(), op, position: p, max_context });
    }
    let (features, number) = match edit {
        SaeEdit::Steer { feature, scale } => (std::slice::from_ref(feature), *scale),
        SaeEdit::Clamp { features, value } => (features.as_slice(), *value),
        SaeEdit::Splice { .. } => (&[][..], 0.0),
    };
    if let Some(&f) = features.iter().find(|&&f| f >= width) {
        return Err(InterventionError::IndexOutOfRange { point: e.point.clone(), index: f, units: width });
    }
    if !number.is_finite() {
        return Err(InterventionError::Invalid {
            point: e.point.clone(),
            op,
            reason: "the value is not finite".into(),
        });
    }
    Ok(())
}

fn validate(e: &Intervention, shape: &[usize], max_context: usize) -> Result<(), InterventionError> {
    let op = e.op.name();
    let point = || e.point.clone();
    let per_position: usize = shape.iter().product();
    let last = shape.last().copied().unwrap_or(0);
    let invalid = |reason: String| InterventionError::Invalid { point: point(), op, reason };
    let finite = |what: &str, v: &[f32]| {
        if v.iter().all(|x| x.is_finite()) {
            Ok(())
        } else {
            Err(invalid(format!("{what} has a value that is not finite")))
        }
    };
    if let Some(positions) = &e.positions {
        if let Some(&p) = positions.iter().find(|&&p| p >= max_context) {
            return Err(InterventionError::PositionOutOfRange { point: point(), op, position: p, max_context });
        }
    }
    match &e.op {
        EditOp::Add { vector, scale } => {
            if vector.len() != last && vector.len() != per_position {
                let expected =
                    if last == per_position { last.to_string() } else { format!("{last} or {per_position}") };
                return Err(InterventionError::WrongSize {
                    point: point(),
                    op,
                    what: "vector",
                    got: vector.len(),
                    expected,
                });
            }
            finite("vector", vector)?;
            if !scale.is_finite() {
                return Err(invalid("scale is not finite".into()));
            }
        }
        EditOp::Set { values } => {
            let Some(positions) = &e.positions else {
                return Err(invalid("`set` needs the positions its rows go to".into()));
            };
            let expected = positions.len() * per_position;
            if values.len() != expected {
                return Err(InterventionError::WrongSize {
                    point: point(),
                    op,
                    what: "values",
                    got: values.len(),
                    expected: format!("{expected} ({} positions × {per_position})", positions.len()),
                });
            }
            finite("values", values)?;
        }
        EditOp::Scale { index, factor } => {
            let units = shape.first().copied().unwrap_or(0);
            if let Some(&i) = index.iter().find(|&&i| i >= units) {
                return Err(InterventionError::IndexOutOfRange { point: point(), index: i, units });
            }
            if !factor.is_finite() {
                return Err(invalid("factor is not finite".into()));
            }
        }
        EditOp::ProjectOut { direction } => {
            if direction.len() != last {
                return Err(InterventionError::WrongSize {
                    point: point(),
                    op,
                    what: "direction",
                    got: direction.len(),
                    expected: last.to_string(),
                });
            }
            finite("direction", direction)?;
            if direction.iter().all(|&x| x == 0.0) {
                return Err(invalid("the direction is zero".into()));
            }
        }
        EditOp::Sae { .. } => unreachable!("feature edits are validated by validate_sae"),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape_of(p: Point) -> Option<PointShape> {
        match p {
            Point::Layer(i, LayerPoint::AttentionHeads) if i < 2 => Some(vec![4, 8]),
            Point::Layer(i, _) if i < 2 => Some(vec![32]),
            Point::Embed | Point::Norm => Some(vec![32]),
            _ => None,
        }
    }

    fn edit(point: &str, op: EditOp, positions: Option<Vec<usize>>) -> Intervention {
        Intervention { point: point.into(), op, positions }
    }

    #[test]
    fn a_bad_edit_rejects_the_whole_list() {
        let good = edit("model.layers.0.output", EditOp::Add { vector: vec![0.0; 32], scale: 1.0 }, None);
        let cases = [
            edit("model.layers.7.output", EditOp::Add { vector: vec![0.0; 32], scale: 1.0 }, None),
            edit("model.layers.0.attention.pattern", EditOp::Scale { index: vec![0], factor: 0.0 }, None),
            edit("model.layers.0.output", EditOp::Add { vector: vec![0.0; 31], scale: 1.0 }, None),
            edit("model.layers.0.attention.heads", EditOp::Scale { index: vec![4], factor: 0.0 }, None),
            edit("model.layers.0.output", EditOp::Set { values: vec![0.0; 32] }, Some(vec![100])),
            edit("model.layers.0.output", EditOp::Set { values: vec![0.0; 32] }, None),
            edit("model.layers.0.output", EditOp::ProjectOut { direction: vec![0.0; 32] }, None),
            edit("model.layers.0.output", EditOp::Add { vector: vec![f32::NAN; 32], scale: 1.0 }, None),
        ];
        for bad in cases {
            assert!(InterventionSet::new(vec![good.clone(), bad.clone()], shape_of, 64).is_err(), "{bad:?}");
        }
        let heads = edit("model.layers.1.attention.heads", EditOp::Add { vector: vec![0.0; 32], scale: 1.0 }, None);
        assert!(InterventionSet::new(vec![good, heads], shape_of, 64).is_ok());
    }

    #[test]
    fn a_feature_edit_resolves_to_its_sae_point() {
        let saes = [("res".to_string(), Point::Layer(1, LayerPoint::Output), 16)];
        let sae = |edit| edit_sae("res", edit);
        let ok = InterventionSet::with_saes(
            vec![sae(SaeEdit::Clamp { features: vec![3, 15], value: 2.0 })],
            shape_of,
            &saes,
            64,
        )
        .unwrap();
        assert!(ok.touches(Point::Layer(1, LayerPoint::Output)));
        for bad in [
            sae(SaeEdit::Steer { feature: 16, scale: 1.0 }),
            sae(SaeEdit::Clamp { features: vec![0], value: f32::INFINITY }),
            edit_sae("other", SaeEdit::Splice { keep_error: true }),
        ] {
            assert!(InterventionSet::with_saes(vec![bad.clone()], shape_of, &saes, 64).is_err(), "{bad:?}");
        }
    }

    fn edit_sae(name: &str, edit: SaeEdit) -> Intervention {
        Intervention { point: format!("sae.{name}"), op: EditOp::Sae { sae: name.into(), edit }, positions: None }
    }
}
