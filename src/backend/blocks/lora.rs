//! LoRA beside the linears (DESIGN §16): `y = W x + Σ s · B (A x)`, a small side product on top of
//! the base product, whose weights stay shared and untouched. Adapters are chosen per sequence:
//! a batched step whose sequences use different adapters (or none) adds each one's term to its
//! own rows only.
//!
//! Which adapters a step runs with is set for the duration of one decoder pass (`with_plan`) on
//! the thread that runs it, and read by `Linear::forward` (`apply`): the blocks' signatures (shared
//! by every caller of the decoder) stay as they are, and a pass with no adapter pays one
//! thread-local read per linear.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::{Arc, RwLock, Weak};

use candle_core::{DType, Device, Tensor};

use crate::backend::config::Architecture;
use crate::backend::error::AdapterError;
use crate::backend::weights::adapter::AdapterWeights;
use crate::backend::weights::names::Slot;

/// One weight slot a linear's output covers: rows `offset..offset + len` of its output are that
/// slot's (a linear of stacked q, k and v has three).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SitePart {
    /// The slot.
    pub slot: Slot,
    /// Its layer (0 for the output projection).
    pub layer: usize,
    /// Its first output column.
    pub offset: usize,
    /// Its output width.
    pub len: usize,
}

/// Where a linear sits in the model, so an adapter's factors can find it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Site {
    /// The slots its output covers, in order.
    pub parts: Vec<SitePart>,
    /// Its input width.
    pub input: usize,
}

impl Site {
    /// The site of a linear that is one slot.
    pub fn one(slot: Slot, layer: usize, out: usize, input: usize) -> Self {
        Self { parts: vec![SitePart { slot, layer, offset: 0, len: out }], input }
    }

    /// The sites of linears stacked side by side into one (`Linear::stack`).
    pub fn stack(sites: &[&Site]) -> Option<Self> {
        let input = sites.first()?.input;
        let mut parts = Vec::new();
        let mut offset = 0;
        for s in sites {
            if s.input != input {
                return None;
            }
            for p in &s.parts {
                parts.push(SitePart { offset: offset + p.offset, ..*p });
            }
            offset += s.parts.iter().map(|p| p.len).sum::<usize>();
        }
        Some(Self { parts, input })
    }

    /// The key an adapter's factors are stored under: the first slot's (unique per linear).
    fn key(&self) -> (Slot, usize) {
        (self.parts[0].slot, self.parts[0].layer)
    }
}

/// One linear's factors, ready: the adapter's term of rows `x` is `x · at · bt`.
#[derive(Debug, Clone)]
struct Factors {
    /// `Aᵀ` `[in, R]`: every adapted slot's `A` stacked.
    at: Tensor,
    /// `(s · B)ᵀ` `[R, out]`: each slot's scaled `B` in its own columns, zero elsewhere.
    bt: Tensor,
    /// The same two on the host, where the model is on the CPU: a decode step's few rows are
    /// multiplied in place (two small loops), not through the matmul kernels, whose dispatch to
    /// the thread pool costs more than the arithmetic at this size.
    host: Option<(Vec<f32>, Vec<f32>)>,
}

/// Rows at most this many go through `Factors::small` on the CPU.
const SMALL_ROWS: usize = 8;

/// One row's term of one adapter in `host_terms`: the factors' host copies, the row, its scale.
type HostJob<'a> = (&'a (Vec<f32>, Vec<f32>), usize, f32);

/// Input (and output) columns per task of `host_terms`: a few cache lines of each factor row.
const HOST_COLUMNS: usize = 256;

/// `d[row] = Σ scale · x[row] · at · bt` over `jobs`, on the host and on both of the kernels'
/// threads: a decode step's LoRA terms are too small for the matmul kernels' dispatch, but their
/// factors (tens of MB over a step) are too large for one thread while the other waits at the
/// pool's barrier. The rank-sized products `x · at` are summed over input slices, then each task
/// adds its own output columns of every job.
fn host_terms(xs: &[f32], inp: usize, out: usize, rows: usize, jobs: &[HostJob<'_>]) -> Vec<f32> {
    use crate::backend::kernels::{parallel_for, OutPtr};

    let ranks: Vec<usize> = jobs.iter().map(|(h, _, _)| h.0.len() / inp.max(1)).collect();
    let mut offsets = Vec::with_capacity(jobs.len());
    let mut total = 0;
    for &r in &ranks {
        offsets.push(total);
        total += r;
    }
    // x · at, per input slice (each task its own partial sums), then summed.
    let slices = inp.div_ceil(HOST_COLUMNS);
    let mut partial = vec![0f32; slices * total];
    let p = OutPtr(partial.as_mut_ptr());
    parallel_for(slices, |c| {
        let p = p;
        let (lo, hi) = (c * HOST_COLUMNS, ((c + 1) * HOST_COLUMNS).min(inp));
        for (j, ((host, row, _), &r)) in jobs.iter().zip(&ranks).enumerate() {
            // SAFETY: slice `c` writes only its own `total` values, at `c · total`.
            let t = unsafe { std::slice::from_raw_parts_mut(p.0.add(c * total + offsets[j]), r) };
            let x = &xs[row * inp + lo..row * inp + hi];
            for (&xi, a) in x.iter().zip(host.0[lo * r..hi * r].chunks_exact(r)) {
                for (tv, &av) in t.iter_mut().zip(a) {
                    *tv += xi * av;
                }
            }
        }
    });
    let mut t = vec![0f32; total];
    for part in partial.chunks_exact(total) {
        for (tv, &pv) in t.iter_mut().zip(part) {
            *tv += pv;
        }
    }
    // (scale · t) · bt, per output slice.
    let mut d = vec![0f32; rows * out];
    let dp = OutPtr(d.as_mut_ptr());
    parallel_for(out.div_ceil(HOST_COLUMNS), |c| {
        let dp = dp;
        let (lo, hi) = (c * HOST_COLUMNS, ((c + 1) * HOST_COLUMNS).min(out));
        for (j, ((host, row, scale), &r)) in jobs.iter().zip(&ranks).enumerate() {
            // SAFETY: slice `c` writes only columns lo..hi of each row.
            let dst = unsafe { std::slice::from_raw_parts_mut(dp.0.add(row * out + lo), hi - lo) };
            for (k, &tv) in t[offsets[j]..offsets[j] + r].iter().enumerate() {
                let tv = tv * scale;
                for (dv, &bv) in dst.iter_mut().zip(&host.1[k * out + lo..k * out + hi]) {
                    *dv += tv * bv;
                }
            }
        }
    });
    d
}

/// How the rows of q's and k's `lora_B` are reordered to fit the base: llama.cpp's converter
/// permutes the Llama family's q/k rows so that RoPE rotates adjacent pairs (`LlamaModel.permute`),
/// and `convert_lora_to_gguf.py` permutes `lora_B` the same way; a PEFT adapter on such a GGUF
/// base needs that done here (`to_pairs`), a GGUF LoRA on a Hugging Face base the inverse.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QkRows {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// From halves (Hugging Face) to adjacent pairs (GGUF); false: back.
    pub to_pairs: bool,
}

impl QkRows {
    /// `b` (`[heads · head_dim, r]`) with each head's rows reordered.
    fn apply(&self, b: &Tensor, heads: usize) -> candle_core::Result<Tensor> {
        let (out, r) = b.dims2()?;
        let half = out / heads.max(1) / 2;
        if half == 0 || heads * half * 2 != out {
            candle_core::bail!("{out} rows are not {heads} heads of an even width");
        }
        let shape = if self.to_pairs { (heads, 2, half, r) } else { (heads, half, 2, r) };
        b.reshape(shape)?.transpose(1, 2)?.contiguous()?.reshape((out, r))
    }
}

/// A LoRA adapter fitted to one model: its factors on the model's device, per linear.
#[derive(Debug)]
pub struct Adapter {
    /// The name it is loaded under.
    pub name: String,
    /// The file or directory it came from.
    pub path: String,
    /// `peft`, `mlx` or `gguf`.
    pub format: &'static str,
    /// The largest rank of its modules.
    pub rank: usize,
    /// How many of the model's weight slots it adapts.
    pub modules: usize,
    /// The scale it runs with where it is chosen by name alone.
    pub scale: f32,
    factors: HashMap<(Slot, usize), Factors>,
}

impl Adapter {
    /// Fits `weights` to the linears at `sites` of a model of architecture `arch`: every module
    /// must name one of them and have the shapes it needs; an error names the first that does not.
    /// `scale` is what it runs with where it is chosen by name alone; `qk_rows`, where the
    /// adapter's q/k row order differs from the base's.
    pub fn prepare(
        name: &str,
        scale: f32,
        weights: AdapterWeights,
        sites: &[&Site],
        arch: Architecture,
        qk_rows: Option<QkRows>,
        device: &Device,
    ) -> Result<Self, AdapterError> {
        let path = weights.path.display().to_string();
        let stems: HashMap<String, (usize, usize)> = sites
            .iter()
            .enumerate()
            .flat_map(|(i, s)| {
                s.parts.iter().enumerate().map(move |(j, p)| (weights.naming.stem(arch, p.slot, p.layer), (i, j)))
            })
            .collect();
        let example =
            sites.first().map(|s| weights.naming.stem(arch, s.parts[0].slot, s.parts[0].layer)).unwrap_or_default();
        let candle = |e: candle_core::Error| AdapterError::Malformed { path: path.clone(), reason: e.to_string() };
        // site → [(part, A, scaled B)]
        let mut per_site: HashMap<usize, Vec<(usize, Tensor, Tensor)>> = HashMap::new();
        let mut rank = 0;
        let count = weights.modules.len();
        for m in weights.modules {
            let Some(&(i, j)) = stems.get(&m.module) else {
                return Err(AdapterError::UnknownModule { path, module: m.module, example });
            };
            let (site, part) = (sites[i], sites[i].parts[j]);
            let (a, b) = (m.a.dims().to_vec(), m.b.dims().to_vec());
            if a.len() != 2 || a[1] != site.input || a[0] == 0 {
                let expected = format!("[r, {}]", site.input);
                return Err(AdapterError::Shape { path, module: m.module, factor: "lora_A", got: a, expected });
            }
            let r = a[0];
            if b.len() != 2 || b != [part.len, r] {
                let expected = format!("[{}, {r}]", part.len);
                return Err(AdapterError::Shape { path, module: m.module, factor: "lora_B", got: b, expected });
            }
            rank = rank.max(r);
            let b = match (qk_rows, part.slot) {
                (Some(q), Slot::Q) => q.apply(&m.b, q.heads).map_err(candle)?,
                (Some(q), Slot::K) => q.apply(&m.b, q.kv_heads).map_err(candle)?,
                _ => m.b,
            };
            let scaled_b = (b * m.scale).map_err(candle)?;
            per_site.entry(i).or_default().push((j, m.a, scaled_b));
        }
        let mut factors = HashMap::with_capacity(per_site.len());
        for (i, mut parts) in per_site {
            let site = sites[i];
            parts.sort_by_key(|(j, _, _)| *j);
            let out: usize = site.parts.iter().map(|p| p.len).sum();
            let a_all: Vec<&Tensor> = parts.iter().map(|(_, a, _)| a).collect();
            let at = Tensor::cat(&a_all, 0).and_then(|a| a.t()?.contiguous()).map_err(candle)?;
            let mut blocks = Vec::with_capacity(parts.len());
            for (j, _, b) in &parts {
                let p = site.parts[*j];
                let r = b.dim(1).map_err(candle)?;
                let bt = b.t().map_err(candle)?;
                let mut row = Vec::with_capacity(3);
                if p.offset > 0 {
                    row.push(Tensor::zeros((r, p.offset), DType::F32, &Device::Cpu).map_err(candle)?);
                }
                row.push(bt);
                if p.offset + p.len < out {
                    row.push(Tensor::zeros((r, out - p.offset - p.len), DType::F32, &Device::Cpu).map_err(candle)?);
                }
                blocks.push(Tensor::cat(&row, 1).map_err(candle)?);
            }
            let bt = Tensor::cat(&blocks, 0).and_then(|b| b.contiguous()).map_err(candle)?;
            let host = if device.is_cpu() {
                let flat = |t: &Tensor| t.flatten_all().and_then(|t| t.to_vec1::<f32>());
                Some((flat(&at).map_err(candle)?, flat(&bt).map_err(candle)?))
            } else {
                None
            };
            let (at, bt) = (at.to_device(device).map_err(candle)?, bt.to_device(device).map_err(candle)?);
            factors.insert(site.key(), Factors { at, bt, host });
        }
        Ok(Self { name: name.to_owned(), path, format: weights.format, rank, modules: count, scale, factors })
    }
}

impl Adapter {
    /// Whether it has factors for the linear at `site`.
    pub fn reaches(&self, site: &Site) -> bool {
        self.factors.contains_key(&site.key())
    }

    /// The change `scale · B A` it makes to the weight (`[out, in]`, float32) of the linear at
    /// `site`, where it reaches it: what `merge` folds in.
    pub fn delta(&self, site: &Site, scale: f32) -> candle_core::Result<Option<Tensor>> {
        let Some(f) = self.factors.get(&site.key()) else { return Ok(None) };
        let d = f.at.matmul(&f.bt)?.t()?.contiguous()?;
        Ok(Some(if scale == 1.0 { d } else { (d * scale as f64)? }))
    }

    /// Itself with no factors: what is kept of an adapter merged into the weights (its description).
    pub fn into_description(mut self) -> Self {
        self.factors = HashMap::new();
        self
    }
}

/// The adapters one sequence runs with, and the scale of each (several are summed, as llama.cpp does).
pub type ActiveAdapters = Vec<(Arc<Adapter>, f32)>;

/// The adapters a session's cached positions were computed under: weak references, so that a
/// cache never keeps an adapter loaded (once unloaded, it matches no choice again).
pub type CachedAdapters = Vec<(Weak<Adapter>, f32)>;

/// `active` as a cache records it.
pub fn cached(active: &ActiveAdapters) -> CachedAdapters {
    active.iter().map(|(a, s)| (Arc::downgrade(a), *s)).collect()
}

/// Whether `active` is what the positions `cached` describes were computed under (the same
/// adapters, the same scales).
pub fn computed_under(active: &ActiveAdapters, cached: &CachedAdapters) -> bool {
    active.len() == cached.len()
        && active.iter().zip(cached).all(|((x, s), (y, t))| std::ptr::eq(Arc::as_ptr(x), y.as_ptr()) && s == t)
}

/// The adapters loaded on a model, shared by every clone and session of it.
#[derive(Debug, Default)]
pub struct AdapterRegistry {
    adapters: RwLock<Vec<Arc<Adapter>>>,
}

impl AdapterRegistry {
    /// The adapters loaded now, in load order.
    pub fn list(&self) -> Vec<Arc<Adapter>> {
        self.adapters.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The adapter loaded as `name`.
    pub fn get(&self, name: &str) -> Result<Arc<Adapter>, AdapterError> {
        let list = self.adapters.read().unwrap_or_else(|e| e.into_inner());
        list.iter()
            .find(|a| a.name == name)
            .cloned()
            .ok_or_else(|| AdapterError::Unknown { name: name.to_owned(), loaded: names_or_none(&list) })
    }

    /// Adds `adapter`, refusing a name already loaded.
    pub fn insert(&self, adapter: Adapter) -> Result<Arc<Adapter>, AdapterError> {
        let mut list = self.adapters.write().unwrap_or_else(|e| e.into_inner());
        if list.iter().any(|a| a.name == adapter.name) {
            return Err(AdapterError::Duplicate { name: adapter.name });
        }
        let adapter = Arc::new(adapter);
        list.push(Arc::clone(&adapter));
        Ok(adapter)
    }

    /// Removes the adapter `name`, refusing one that a session still runs with.
    pub fn remove(&self, name: &str) -> Result<(), AdapterError> {
        let mut list = self.adapters.write().unwrap_or_else(|e| e.into_inner());
        let Some(i) = list.iter().position(|a| a.name == name) else {
            return Err(AdapterError::Unknown { name: name.to_owned(), loaded: names_or_none(&list) });
        };
        // The registry holds one reference; any other is a session's (or a running request's).
        let users = Arc::strong_count(&list[i]) - 1;
        if users > 0 {
            return Err(AdapterError::InUse { name: name.to_owned(), users });
        }
        list.remove(i);
        Ok(())
    }
}

fn names_or_none(list: &[Arc<Adapter>]) -> String {
    if list.is_empty() {
        "none".into()
    } else {
        list.iter().map(|a| a.name.as_str()).collect::<Vec<_>>().join(", ")
    }
}

/// The adapters of one decoder pass: each sequence's rows (`lens`, stacked in order) and, per
/// distinct adapter, the sequences that use it with their scales.
struct Plan {
    lens: Vec<usize>,
    groups: Vec<(Arc<Adapter>, Vec<(usize, f32)>)>,
}

thread_local! {
    static PLAN: RefCell<Option<Rc<Plan>>> = const { RefCell::new(None) };
}

/// Clears the pass's plan when the pass ends, even by unwinding.
struct PlanGuard(Option<Rc<Plan>>);

impl Drop for PlanGuard {
    fn drop(&mut self) {
        let previous = self.0.take();
        PLAN.with(|p| *p.borrow_mut() = previous);
    }
}

/// Runs `pass` (one decoder pass over sequences of `lens` rows) with sequence `i` running
/// `per_item[i]`'s adapters; with no adapter anywhere it is `pass()` itself.
pub fn with_plan<T>(per_item: &[Option<&ActiveAdapters>], lens: &[usize], pass: impl FnOnce() -> T) -> T {
    let mut groups: Vec<(Arc<Adapter>, Vec<(usize, f32)>)> = Vec::new();
    for (i, active) in per_item.iter().enumerate() {
        for (adapter, scale) in active.iter().flat_map(|a| a.iter()) {
            match groups.iter_mut().find(|(a, _)| Arc::ptr_eq(a, adapter)) {
                Some((_, users)) => users.push((i, *scale)),
                None => groups.push((Arc::clone(adapter), vec![(i, *scale)])),
            }
        }
    }
    if groups.is_empty() {
        return pass();
    }
    let plan = Rc::new(Plan { lens: lens.to_vec(), groups });
    let previous = PLAN.with(|p| p.borrow_mut().replace(plan));
    let _guard = PlanGuard(previous);
    pass()
}

/// `x` (the embedding rows of the token `ids` of the current pass) plus the term of every
/// adapter the pass runs that adapts the embedding at `site`: `s · B A[:, id]` on its own
/// sequences' rows (the product of a linear's factors with the token's one-hot row).
pub fn apply_embedding(site: &Site, ids: &Tensor, x: Tensor) -> candle_core::Result<Tensor> {
    let Some(plan) = PLAN.with(|p| p.borrow().clone()) else { return Ok(x) };
    let key = site.key();
    let mut x = x;
    let mut starts = Vec::with_capacity(plan.lens.len());
    let mut at = 0;
    for &t in &plan.lens {
        starts.push(at);
        at += t;
    }
    if at != x.dim(0)? {
        candle_core::bail!("LoRA: {} embedding rows do not match the step's sequences {:?}", x.dim(0)?, plan.lens)
    }
    for (adapter, users) in &plan.groups {
        let Some(f) = adapter.factors.get(&key) else { continue };
        let mut index = Vec::new();
        let mut scales = Vec::new();
        for &(i, s) in users {
            index.extend((starts[i]..starts[i] + plan.lens[i]).map(|r| r as u32));
            scales.extend(std::iter::repeat_n(s, plan.lens[i]));
        }
        let n = index.len();
        let index = Tensor::from_vec(index, n, x.device())?;
        let scales = Tensor::from_vec(scales, (n, 1), x.device())?;
        let tokens = ids.index_select(&index, 0)?;
        let d = f.at.index_select(&tokens, 0)?.matmul(&f.bt)?.broadcast_mul(&scales)?;
        x = x.index_add(&index, &d.to_dtype(x.dtype())?, 0)?;
    }
    Ok(x)
}

/// `y` (the base product of `x` `[rows, in]` at `site`) plus the term of every adapter the
/// current pass runs at this site, each on its own sequences' rows.
pub fn apply(site: &Site, x: &Tensor, y: Tensor) -> candle_core::Result<Tensor> {
    let Some(plan) = PLAN.with(|p| p.borrow().clone()) else { return Ok(y) };
    let key = site.key();
    let rows = x.dim(0)?;
    let items = plan.lens.len();
    // The final norm and logits may cover only each sequence's last row.
    let lens: Vec<usize> = if rows == plan.lens.iter().sum::<usize>() {
        plan.lens.clone()
    } else if rows == items {
        vec![1; items]
    } else {
        candle_core::bail!("LoRA: {rows} rows do not match the step's sequences {:?}", plan.lens)
    };
    let mut starts = Vec::with_capacity(items);
    let mut at = 0;
    for &t in &lens {
        starts.push(at);
        at += t;
    }
    // A decode step's few rows on the CPU: every adapter's term in one pass on the host and one add.
    let factors: Vec<(&Factors, &Vec<(usize, f32)>)> =
        plan.groups.iter().filter_map(|(a, users)| a.factors.get(&key).map(|f| (f, users))).collect();
    if factors.is_empty() {
        return Ok(y);
    }
    if rows <= SMALL_ROWS && factors.iter().all(|(f, _)| f.host.is_some()) {
        let inp = x.dim(1)?;
        let out = y.dim(1)?;
        let xs = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let mut jobs: Vec<HostJob<'_>> = Vec::new();
        for (f, users) in &factors {
            let host = f.host.as_ref().expect("checked above");
            for &(i, scale) in users.iter() {
                jobs.extend((starts[i]..starts[i] + lens[i]).map(|row| (host, row, scale)));
            }
        }
        let d = Tensor::from_vec(host_terms(&xs, inp, out, rows, &jobs), (rows, out), y.device())?;
        return y + d;
    }
    let mut y = y;
    for (adapter, users) in &plan.groups {
        let Some(f) = adapter.factors.get(&key) else { continue };
        let everyone = users.len() == items && users.iter().all(|(_, s)| *s == users[0].1);
        if everyone {
            let d = x.matmul(&f.at)?.matmul(&f.bt)?;
            let d = if users[0].1 == 1.0 { d } else { (d * users[0].1 as f64)? };
            y = (y + d)?;
            continue;
        }
        let mut index = Vec::new();
        let mut scales = Vec::new();
        for &(i, s) in users {
            index.extend((starts[i]..starts[i] + lens[i]).map(|r| r as u32));
            scales.extend(std::iter::repeat_n(s, lens[i]));
        }
        let n = index.len();
        let index = Tensor::from_vec(index, n, x.device())?;
        let scales = Tensor::from_vec(scales, (n, 1), x.device())?;
        let d = x.index_select(&index, 0)?.matmul(&f.at)?.matmul(&f.bt)?.broadcast_mul(&scales)?;
        y = y.index_add(&index, &d, 0)?;
    }
    Ok(y)
}
