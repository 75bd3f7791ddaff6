//! What the decoder does at each named point: nothing on the plain path, or record the
//! selected activations and apply the edits of docs/interventions.md.

use std::collections::HashSet;

use candle_core::{DType, Device, Tensor, D};

use crate::backend::error::{CandleContext, Result};
use crate::backend::host::to_host_f32;
use crate::core::{EditOp, InterventionSet, ObservationRequest, ObservationSet, ObservationValue, Point};

/// Where the decoder reports its named points. The plain path uses `NoHooks`, whose methods
/// are empty and inline away: ordinary inference formats no name, keeps no tensor and edits nothing.
pub trait Hooks {
    /// Whether `point` is observed (decides how many rows the final points cover, and whether
    /// the attention pattern is materialised at all).
    fn wants(&self, point: Point) -> bool;
    /// Offers the value at `point`; returns it, edited where an intervention applies there.
    fn at(&mut self, point: Point, x: Tensor) -> candle_core::Result<Tensor>;
    /// Whether these hooks never observe or edit anything (lets a batched step skip splitting rows).
    fn is_noop(&self) -> bool {
        false
    }
}

impl<H: Hooks> Hooks for &mut H {
    fn wants(&self, point: Point) -> bool {
        (**self).wants(point)
    }
    fn at(&mut self, point: Point, x: Tensor) -> candle_core::Result<Tensor> {
        (**self).at(point, x)
    }
    fn is_noop(&self) -> bool {
        (**self).is_noop()
    }
}

/// Observes and edits nothing.
pub struct NoHooks;

impl Hooks for NoHooks {
    #[inline(always)]
    fn wants(&self, _point: Point) -> bool {
        false
    }
    #[inline(always)]
    fn at(&mut self, _point: Point, x: Tensor) -> candle_core::Result<Tensor> {
        Ok(x)
    }
    #[inline(always)]
    fn is_noop(&self) -> bool {
        true
    }
}

/// One edit made ready for a device: vectors already on it, scaled and normalised.
#[derive(Debug, Clone)]
enum ReadyOp {
    Add(Tensor),
    Set { values: Vec<f32>, row: usize },
    Scale { index: Vec<usize>, factor: f32 },
    ProjectOut(Tensor),
}

/// Edits ready to run on one device; built once when set, not on every step.
#[derive(Debug, Clone, Default)]
pub struct ReadyEdits {
    edits: Vec<(Point, ReadyOp, Option<Vec<usize>>)>,
}

impl ReadyEdits {
    /// Moves the validated `set` onto `device`; `shape_of` gives each point's per-position shape.
    pub fn new(set: &InterventionSet, shape_of: impl Fn(Point) -> Vec<usize>, device: &Device) -> Result<Self> {
        let mut edits = Vec::new();
        for (point, e) in set.iter() {
            let shape = shape_of(*point);
            let ready = match &e.op {
                EditOp::Add { vector, scale } => {
                    let dims = if vector.len() == shape.iter().product::<usize>() {
                        shape.clone()
                    } else {
                        vec![vector.len()]
                    };
                    let scaled: Vec<f32> = vector.iter().map(|v| v * scale).collect();
                    ReadyOp::Add(
                        Tensor::from_vec(scaled, dims, device).ctx(|| format!("preparing `add` on `{point}`"))?,
                    )
                }
                EditOp::Set { values } => ReadyOp::Set { values: values.clone(), row: shape.iter().product() },
                EditOp::Scale { index, factor } => ReadyOp::Scale { index: index.clone(), factor: *factor },
                EditOp::ProjectOut { direction } => {
                    let norm = direction.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>().sqrt();
                    let unit: Vec<f32> = direction.iter().map(|&x| (x as f64 / norm) as f32).collect();
                    let n = unit.len();
                    ReadyOp::ProjectOut(
                        Tensor::from_vec(unit, n, device).ctx(|| format!("preparing `project_out` on `{point}`"))?,
                    )
                }
            };
            edits.push((*point, ready, e.positions.clone()));
        }
        Ok(Self { edits })
    }

    /// Whether there is no edit.
    pub fn is_empty(&self) -> bool {
        self.edits.is_empty()
    }

    /// These edits followed by `other`'s.
    pub fn then(&self, other: &ReadyEdits) -> ReadyEdits {
        let mut edits = self.edits.clone();
        edits.extend(other.edits.iter().cloned());
        Self { edits }
    }
}

/// Records what a request selects and applies edits, for one step at positions `pos..pos + t`.
pub struct StepHooks<'a> {
    request: Option<&'a ObservationRequest>,
    edits: &'a ReadyEdits,
    /// Which points any edit touches, so untouched points cost one hash lookup.
    edited: HashSet<Point>,
    kept: Vec<(Point, Tensor)>,
    pos: usize,
}

impl<'a> StepHooks<'a> {
    /// Hooks for one step starting at `pos`; `request` is `None` when nothing is observed.
    pub fn new(request: Option<&'a ObservationRequest>, edits: &'a ReadyEdits, pos: usize) -> Self {
        let edited = edits.edits.iter().map(|(p, _, _)| *p).collect();
        Self { request, edits, edited, kept: Vec::new(), pos }
    }

    /// Copies the recorded tensors to the host as float32.
    pub fn finish(self) -> Result<ObservationSet> {
        let mut set = ObservationSet::new();
        for (point, t) in self.kept {
            let (shape, data) = to_host_f32(&t).ctx(|| format!("copying observation `{point}` to the host"))?;
            set.insert(point.to_string(), ObservationValue::Tensor { shape, data })?;
        }
        Ok(set)
    }

    /// Rows of this step (of `t`) that `positions` selects; `None` means all of them.
    fn rows(&self, positions: &Option<Vec<usize>>, t: usize) -> Option<Vec<usize>> {
        positions
            .as_ref()
            .map(|ps| ps.iter().filter(|&&p| p >= self.pos && p < self.pos + t).map(|p| p - self.pos).collect())
    }

    fn apply(&self, point: Point, mut x: Tensor) -> candle_core::Result<Tensor> {
        for (p, op, positions) in &self.edits.edits {
            if *p != point {
                continue;
            }
            let t = x.dim(0)?;
            let rows = self.rows(positions, t);
            if rows.as_ref().is_some_and(Vec::is_empty) {
                continue;
            }
            // A [t, 1, ...] mask of the selected rows, broadcast over the point's other dimensions.
            let mask = |rows: &[usize]| -> candle_core::Result<Tensor> {
                let mut m = vec![0f32; t];
                rows.iter().for_each(|&r| m[r] = 1.0);
                let mut dims = vec![1usize; x.rank()];
                dims[0] = t;
                Tensor::from_vec(m, dims, x.device())
            };
            x = match op {
                ReadyOp::Add(v) => match &rows {
                    None => x.broadcast_add(v)?,
                    Some(rows) => (&x + v.broadcast_mul(&mask(rows)?)?)?,
                },
                ReadyOp::Set { values, row } => {
                    let all = positions.as_ref().expect("validated: `set` has positions");
                    let rows = rows.expect("validated: `set` has positions");
                    let mut dense = vec![0f32; t * row];
                    for (k, &p) in all.iter().enumerate() {
                        if p >= self.pos && p < self.pos + t {
                            let r = p - self.pos;
                            dense[r * row..(r + 1) * row].copy_from_slice(&values[k * row..(k + 1) * row]);
                        }
                    }
                    let dense = Tensor::from_vec(dense, x.dims(), x.device())?;
                    let m = mask(&rows)?;
                    (x.broadcast_mul(&(1.0 - &m)?)? + dense)?
                }
                ReadyOp::Scale { index, factor } => {
                    let units = x.dim(1)?;
                    let mut f = vec![1f32; t * units];
                    let selected: Vec<usize> = rows.unwrap_or_else(|| (0..t).collect());
                    for r in selected {
                        for &u in index {
                            f[r * units + u] = *factor;
                        }
                    }
                    let mut dims = vec![1usize; x.rank()];
                    dims[0] = t;
                    dims[1] = units;
                    x.broadcast_mul(&Tensor::from_vec(f, dims, x.device())?)?
                }
                ReadyOp::ProjectOut(d) => {
                    let along = x.broadcast_mul(d)?.sum_keepdim(D::Minus1)?;
                    let along = match &rows {
                        None => along,
                        Some(rows) => along.broadcast_mul(&mask(rows)?)?,
                    };
                    (&x - along.broadcast_mul(d)?)?
                }
            };
        }
        Ok(x)
    }
}

impl Hooks for StepHooks<'_> {
    fn wants(&self, point: Point) -> bool {
        self.request.is_some_and(|r| r.matches_point(point))
    }

    fn at(&mut self, point: Point, x: Tensor) -> candle_core::Result<Tensor> {
        let x = if self.edited.contains(&point) { self.apply(point, x.to_dtype(DType::F32)?)? } else { x };
        if self.wants(point) {
            self.kept.push((point, x.clone()));
        }
        Ok(x)
    }
}
