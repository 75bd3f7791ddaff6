//! What the decoder does at each named point: nothing on the plain path, or record the
//! selected activations and apply the edits of docs/interventions.md.

use std::collections::HashSet;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor, D};

use crate::backend::blocks::sae::Sae;
use crate::backend::error::{CandleContext, Result};
use crate::backend::host::to_host_f32;
use crate::core::{
    EditOp, InterventionSet, LayerPoint, ObservationRequest, ObservationSet, ObservationValue, Point, SaeEdit, SaePoint,
};

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
    /// Absolute position ranges `[start, end)` whose tokens attend each other in both directions
    /// within the causal mask (an image's tokens in Gemma 3); empty for plain text.
    fn bidirectional_blocks(&self) -> Vec<(usize, usize)> {
        Vec::new()
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
    fn bidirectional_blocks(&self) -> Vec<(usize, usize)> {
        (**self).bidirectional_blocks()
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
    Sae { sae: Arc<Sae>, edit: SaeEdit },
}

/// Edits ready to run on one device; built once when set, not on every step.
#[derive(Debug, Clone, Default)]
pub struct ReadyEdits {
    edits: Vec<(Point, ReadyOp, Option<Vec<usize>>)>,
}

impl ReadyEdits {
    /// Moves the validated `set` onto `device`; `shape_of` gives each point's per-position shape,
    /// `saes` the attached SAEs its feature edits name.
    pub fn new(
        set: &InterventionSet,
        shape_of: impl Fn(Point) -> Vec<usize>,
        saes: &[Arc<Sae>],
        device: &Device,
    ) -> Result<Self> {
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
                EditOp::Sae { sae, edit } => {
                    let sae = saes.iter().find(|s| &s.name == sae).ok_or_else(|| {
                        crate::core::InterventionError::UnknownSae { name: sae.clone(), attached: "none".into() }
                    })?;
                    ReadyOp::Sae { sae: Arc::clone(sae), edit: edit.clone() }
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

/// Records what a request selects and applies edits, for a call at positions
/// `start..start + tokens` run in one step or in several chunks.
pub struct StepHooks<'a> {
    request: Option<&'a ObservationRequest>,
    edits: &'a ReadyEdits,
    /// Which points any edit touches, so untouched points cost one hash lookup.
    edited: HashSet<Point>,
    /// What the step in flight recorded, still on the device.
    kept: Vec<(Point, Tensor)>,
    /// The call's observations on the host, at full size, filled in chunk by chunk.
    assembled: Vec<(Point, Vec<usize>, Vec<f32>)>,
    /// The first position of the step in flight.
    pos: usize,
    /// The call's first position and its number of tokens.
    start: usize,
    tokens: usize,
    /// The attached SAEs the request observes, with which of their points (`SaePoint::ALL` order).
    saes: Vec<(Arc<Sae>, [bool; 3])>,
    /// Their observations on the host, rows appended step by step.
    sae_values: Vec<(String, ObservationValue)>,
}

impl<'a> StepHooks<'a> {
    /// Hooks for a call of `tokens` tokens starting at `pos`; `request` is `None` when nothing is
    /// observed.
    pub fn new(request: Option<&'a ObservationRequest>, edits: &'a ReadyEdits, pos: usize, tokens: usize) -> Self {
        let edited = edits.edits.iter().map(|(p, _, _)| *p).collect();
        Self {
            request,
            edits,
            edited,
            kept: Vec::new(),
            assembled: Vec::new(),
            pos,
            start: pos,
            tokens,
            saes: Vec::new(),
            sae_values: Vec::new(),
        }
    }

    /// Also records the points of those `saes` the request selects.
    pub fn with_saes(mut self, saes: &[Arc<Sae>]) -> Self {
        if let Some(r) = self.request {
            self.saes = saes
                .iter()
                .filter_map(|s| {
                    let wanted = SaePoint::ALL.map(|p| r.matches(&p.path(&s.name)));
                    wanted.iter().any(|&w| w).then(|| (Arc::clone(s), wanted))
                })
                .collect();
        }
        self
    }

    /// Runs the SAEs observed at `point` on its value `x` and appends their rows.
    fn record_saes(&mut self, point: Point, x: &Tensor) -> candle_core::Result<()> {
        for (sae, wanted) in &self.saes {
            if sae.point != point {
                continue;
            }
            let (f, recon, error) = if wanted[1] || wanted[2] {
                let (f, r, e) = sae.run(x)?;
                (f, Some(r), Some(e))
            } else {
                (sae.features(x)?, None, None)
            };
            if wanted[0] {
                let (shape, data) = to_host_f32(&f).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
                let width = shape[1];
                let path = SaePoint::Features.path(&sae.name);
                let entry = match self.sae_values.iter().position(|(p, _)| *p == path) {
                    Some(i) => &mut self.sae_values[i].1,
                    None => {
                        let empty = ObservationValue::Sparse {
                            rows: 0,
                            width,
                            offsets: vec![0],
                            indices: vec![],
                            values: vec![],
                        };
                        self.sae_values.push((path, empty));
                        &mut self.sae_values.last_mut().expect("just pushed").1
                    }
                };
                if let ObservationValue::Sparse { rows, offsets, indices, values, .. } = entry {
                    for row in data.chunks(width.max(1)) {
                        for (i, &v) in row.iter().enumerate() {
                            if v != 0.0 {
                                indices.push(i as u32);
                                values.push(v);
                            }
                        }
                        offsets.push(indices.len());
                        *rows += 1;
                    }
                }
            }
            for (k, t) in [(1, recon), (2, error)] {
                let (Some(t), true) = (t, wanted[k]) else { continue };
                let (shape, data) = to_host_f32(&t).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
                let path = SaePoint::ALL[k].path(&sae.name);
                match self.sae_values.iter_mut().find(|(p, _)| *p == path) {
                    Some((_, ObservationValue::Tensor { shape: s, data: d })) => {
                        s[0] += shape[0];
                        d.extend_from_slice(&data);
                    }
                    _ => self.sae_values.push((path, ObservationValue::Tensor { shape, data })),
                }
            }
        }
        Ok(())
    }

    /// Ends the step of `t` positions just run: what it recorded goes to the host, into the
    /// call's observations at its rows, and the next step starts after it. A chunked call's
    /// observations are thus what one step over all its tokens would have recorded, held once.
    pub fn end_step(&mut self, t: usize) -> Result<()> {
        let offset = self.pos - self.start;
        for (point, tensor) in std::mem::take(&mut self.kept) {
            let (shape, data) = to_host_f32(&tensor).ctx(|| format!("copying observation `{point}` to the host"))?;
            let pattern = matches!(point, Point::Layer(_, LayerPoint::AttentionPattern));
            // [T, ...] points stack their chunks' rows; a pattern `[heads, t, keys]` spans the
            // keys up to the chunk's last position, and the later keys of the call are masked (0).
            let rows_axis = usize::from(pattern);
            if shape.get(rows_axis) != Some(&t) {
                // The decoder computes every row of an observed point; anything else is a bug.
                return Err(crate::backend::error::CandleError::Candle {
                    context: format!("assembling observation `{point}` from a step of {t} tokens"),
                    source: candle_core::Error::Msg(format!("the step recorded shape {shape:?}")),
                });
            }
            let i = match self.assembled.iter().position(|(p, _, _)| *p == point) {
                Some(i) => i,
                None => {
                    let mut full = shape.clone();
                    full[rows_axis] = self.tokens;
                    if pattern {
                        full[2] = self.start + self.tokens;
                    }
                    let n = full.iter().product();
                    self.assembled.push((point, full, vec![0f32; n]));
                    self.assembled.len() - 1
                }
            };
            let (_, full, out) = &mut self.assembled[i];
            if pattern {
                let (heads, keys, full_keys) = (shape[0], shape[2], full[2]);
                for h in 0..heads {
                    for r in 0..t {
                        let dst = (h * self.tokens + offset + r) * full_keys;
                        out[dst..dst + keys].copy_from_slice(&data[(h * t + r) * keys..(h * t + r + 1) * keys]);
                    }
                }
            } else {
                let row = data.len() / t.max(1);
                out[offset * row..(offset + t) * row].copy_from_slice(&data);
            }
        }
        self.pos += t;
        Ok(())
    }

    /// The call's observations (`end_step` ran after its every step).
    pub fn finish(mut self) -> Result<ObservationSet> {
        debug_assert!(self.kept.is_empty(), "a step's observations were not ended");
        let mut set = ObservationSet::new();
        for (point, shape, data) in self.assembled.drain(..) {
            set.insert(point.to_string(), ObservationValue::Tensor { shape, data })?;
        }
        for (path, value) in self.sae_values.drain(..) {
            set.insert(path, value)?;
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
                ReadyOp::Sae { sae, edit } => {
                    let m = match &rows {
                        None => None,
                        Some(rows) => {
                            let mut m = vec![0f32; t];
                            rows.iter().for_each(|&r| m[r] = 1.0);
                            Some(Tensor::from_vec(m, (t, 1), x.device())?)
                        }
                    };
                    sae.apply(edit, &x, m.as_ref())?
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
        if !self.saes.is_empty() {
            self.record_saes(point, &x)?;
        }
        Ok(x)
    }
}
