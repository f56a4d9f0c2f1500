//! The `Module` trait: what a layer must say so that it can run plain or inside a pipeline stage.

use wgpipe_tensor::rng::{splitmix64, GOLDEN_GAMMA};
use wgpipe_tensor::{DType, Device, Result, Tensor};

mod cost;

use crate::param::Param;
use crate::var::Var;
pub use cost::measured_cost;
use cost::short_type_name;

/// Where a forward call happens: which step, micro-batch and layer (the keys of the counter-based
/// RNG, so dropout replays bit-identically on recompute), whether the model trains, and whether
/// this call is a re-materialization (layers with side effects, like batch-norm statistics,
/// must not apply them twice).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ForwardCtx {
    pub seed: u64,
    pub step: u64,
    pub micro_batch: u64,
    /// Index of the layer in the whole sequence (not in its stage), so results do not depend
    /// on how the model is cut.
    pub layer: u64,
    pub train: bool,
    pub recompute: bool,
    /// The dtype layers compute in (autocast): `F32` runs everything in f32; with `F16`/`BF16`
    /// matmul-like layers cast their input and a cached half copy of their f32 master weights
    /// to it, norms run on the half stream, losses in f32 (the policy table is in
    /// `wgpipe_models::autocast`). Set by the pipeline's precision.
    pub compute: DType,
    /// Cached decoding (generation with a KV cache): `Some(p)` says the input holds the tokens
    /// at positions `p..p + t` of each sequence, and attention layers keep their keys and
    /// values per micro-batch between calls: `p = 0` starts a micro-batch's cache anew (the
    /// prompt), a later call appends its one token to the `p` positions the cache holds. A
    /// layer that keeps no cache and depends on positions refuses it. `None`: no cache.
    pub kv_position: Option<usize>,
}

/// The default context is [`ForwardCtx::eval`]: what deterministic layers (and inference) need.
impl Default for ForwardCtx {
    fn default() -> Self {
        ForwardCtx::eval()
    }
}

impl ForwardCtx {
    /// Context for evaluation (no dropout, no statistics updates); also `ForwardCtx::default()`.
    /// Layers without randomness or running statistics (linear, attention, norms, activations)
    /// compute the same with any context, so this is all they need; see [`Module::apply`].
    pub fn eval() -> Self {
        ForwardCtx {
            seed: 0,
            step: 0,
            micro_batch: 0,
            layer: 0,
            train: false,
            recompute: false,
            compute: DType::F32,
            kv_position: None,
        }
    }
    /// Context for training step `step`, micro-batch `micro_batch`, with RNG seed `seed`.
    pub fn train(seed: u64, step: u64, micro_batch: u64) -> Self {
        ForwardCtx {
            seed,
            step,
            micro_batch,
            layer: 0,
            train: true,
            recompute: false,
            compute: DType::F32,
            kv_position: None,
        }
    }
    pub fn at_layer(self, layer: u64) -> Self {
        ForwardCtx { layer, ..self }
    }
    /// The same context decoding at `position` with a KV cache (see [`ForwardCtx::kv_position`]).
    pub fn at_kv_position(self, position: usize) -> Self {
        ForwardCtx {
            kv_position: Some(position),
            ..self
        }
    }
    /// The same context computing in `compute` (see [`ForwardCtx::compute`]).
    pub fn with_compute(self, compute: DType) -> Self {
        ForwardCtx { compute, ..self }
    }
    /// The RNG stream of random op number `site` inside this layer: `(seed, offset)` for
    /// `Tensor::dropout_mask`. Distinct for every (step, micro-batch, layer, site).
    pub fn rng_stream(&self, site: u64) -> (u64, u64) {
        let mut h = self.seed ^ GOLDEN_GAMMA;
        for v in [self.step, self.micro_batch, self.layer, site] {
            h = splitmix64(h ^ v);
        }
        (self.seed, h)
    }
    /// The inverted-dropout multipliers of `shape` for random op `site` (see
    /// [`Self::rng_stream`]), or `None` when nothing is dropped (`!train` or `p == 0`).
    pub fn dropout_mask(
        &self,
        shape: &[usize],
        p: f32,
        site: u64,
        dev: &Device,
    ) -> Result<Option<Tensor>> {
        if !self.train || p == 0.0 {
            return Ok(None);
        }
        let (seed, offset) = self.rng_stream(site);
        Tensor::dropout_mask(shape, p, seed, offset, dev).map(Some)
    }
}

/// The naming rule of nested parameters and buffers, `"{prefix}.{name}"` (what checkpoint
/// files key on): a child `attn` of a block `3` names its `q.weight` `3.attn.q.weight`.
pub fn param_path(prefix: &str, name: &str) -> String {
    format!("{prefix}.{name}")
}

/// Gathers a module's parameters (or buffers) from its fields, naming them, so a custom module
/// does not write prefixes by hand:
///
/// ```
/// # use wgpipe_autograd::{module::ParamList, Param, Module};
/// # fn demo(scale: &Param, fc: &dyn Module, bias: Option<&Param>) -> Vec<(String, Param)> {
/// ParamList::new()
///     .param("scale", scale)   // "scale"
///     .child("fc", fc)         // "fc.weight", "fc.bias"
///     .opt("bias", bias)       // "bias" when present
///     .into()
/// # }
/// ```
#[derive(Default, Clone)]
pub struct ParamList(Vec<(String, Param)>);

impl ParamList {
    pub fn new() -> Self {
        ParamList::default()
    }

    /// One parameter of this module, named `name`.
    pub fn param(mut self, name: &str, p: &Param) -> Self {
        self.0.push((name.to_string(), p.clone()));
        self
    }

    /// An optional parameter (e.g. a bias), skipped when absent.
    pub fn opt(self, name: &str, p: Option<&Param>) -> Self {
        match p {
            Some(p) => self.param(name, p),
            None => self,
        }
    }

    /// Every parameter of child module `m`, named `"{name}.{its name}"`.
    pub fn child(self, name: &str, m: &dyn Module) -> Self {
        self.prefixed(name, m.parameters())
    }

    /// Every buffer of child module `m`, named `"{name}.{its name}"`.
    pub fn child_buffers(self, name: &str, m: &dyn Module) -> Self {
        self.prefixed(name, m.buffers())
    }

    /// Already named parameters, each prefixed with `prefix`.
    pub fn prefixed(mut self, prefix: &str, params: Vec<(String, Param)>) -> Self {
        self.0
            .extend(params.into_iter().map(|(n, p)| (param_path(prefix, &n), p)));
        self
    }
}

impl From<ParamList> for Vec<(String, Param)> {
    fn from(l: ParamList) -> Self {
        l.0
    }
}

/// A child module held as itself or boxed: how the code `#[derive(Module)]` writes reaches a
/// `Linear` field and a `Box<dyn Module>` field the same way.
pub trait AsModule {
    fn as_module(&self) -> &dyn Module;
    fn as_module_mut(&mut self) -> &mut dyn Module;
}

impl<M: Module> AsModule for M {
    fn as_module(&self) -> &dyn Module {
        self
    }
    fn as_module_mut(&mut self) -> &mut dyn Module {
        self
    }
}

impl AsModule for Box<dyn Module> {
    fn as_module(&self) -> &dyn Module {
        &**self
    }
    fn as_module_mut(&mut self) -> &mut dyn Module {
        &mut **self
    }
}

/// What a layer costs for a given input shape; the pipeline balances stages with these.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CostHint {
    pub param_bytes: usize,
    /// Forward FLOPs for the input shape (backward is about twice that).
    pub flops: f64,
    /// Bytes of activations the forward keeps for backward.
    pub activation_bytes: usize,
    pub output_shape: Vec<usize>,
}

impl CostHint {
    /// A layer that costs nothing and keeps its input's shape (an identity, a probe, a layer
    /// held elsewhere).
    pub fn pass_through(input_shape: &[usize]) -> CostHint {
        CostHint {
            output_shape: input_shape.to_vec(),
            ..CostHint::default()
        }
    }
}

/// The name of parameter (or buffer) `name` of layer `layer` in a layer sequence:
/// `"{layer}.{name}"` (e.g. `3.attn.q.weight`). Checkpoint files key tensors by it, so every
/// place that names a sequence's parameters (plain sequences, pipeline stages, checkpoints)
/// calls this one function (the [`param_path`] rule with the layer index as prefix).
pub fn layer_param_name(layer: usize, name: &str) -> String {
    param_path(&layer.to_string(), name)
}

/// A layer, or a sequence of layers. `Send` so a pipeline stage can own it on its own thread.
///
/// The one method a layer must write is [`Module::forward`]; the others have defaults that
/// are right for most layers: the name is the type's, [`Module::cost`] is measured by running
/// the layer once ([`measured_cost`]), and a layer with parameters either lists them in
/// [`Module::parameters`] or declares them once, as fields, with `#[derive(Module)]` (its
/// field attributes are in the `wgpipe-derive` crate). A layer reads each weight with
/// [`Var::param`], which gives it in the input's dtype, so the same code runs in f32 and under
/// f16/bf16 autocast:
///
/// ```
/// use wgpipe_autograd::{ForwardCtx, Module, Param, Tape, Var};
/// use wgpipe_tensor::{Device, Result, Tensor};
///
/// /// `x * scale + shift`, with a checkpoint naming its tensors `scale` and `shift`.
/// #[derive(Module)]
/// struct Affine {
///     scale: Param,
///     shift: Option<Param>,
/// }
///
/// impl Affine {
///     fn forward(&self, x: &Var, _ctx: &ForwardCtx) -> Result<Var> {
///         let y = x.mul(&x.param(&self.scale)?)?;
///         match &self.shift {
///             Some(b) => y.add(&x.param(b)?),
///             None => Ok(y),
///         }
///     }
/// }
///
/// # fn main() -> Result<()> {
/// let cpu = Device::cpu();
/// let affine = Affine {
///     scale: Param::new("scale", Tensor::from_vec(vec![2.0; 4], &[4], &cpu)?),
///     shift: Some(Param::new("shift", Tensor::zeros(&[4], &cpu)?)),
/// };
/// let names: Vec<String> = affine.parameters().into_iter().map(|(n, _)| n).collect();
/// assert_eq!(names, ["scale", "shift"]);
/// assert_eq!(affine.cost(&[3, 4]).output_shape, [3, 4]); // measured by one run
/// let tape = Tape::new();
/// let y = affine.apply(&tape.leaf(Tensor::from_vec(vec![1.0; 12], &[3, 4], &cpu)?))?;
/// assert_eq!(y.value().to_vec()?, vec![2.0; 12]);
/// # Ok(())
/// # }
/// ```
pub trait Module: Send {
    /// A short name for reports, e.g. `"Linear(512->512)"`; by default the type's name.
    fn name(&self) -> String {
        short_type_name(std::any::type_name::<Self>())
    }
    /// Runs the layer on `x`, recording on `x`'s tape (or not, if the tape does not record).
    fn forward(&self, x: &Var, ctx: &ForwardCtx) -> Result<Var>;
    /// [`Module::forward`] with the default context ([`ForwardCtx::eval`]): no dropout, no
    /// statistics updates. The short path for deterministic layers and for inference; gradients
    /// are recorded as usual when `x`'s tape records.
    fn apply(&self, x: &Var) -> Result<Var> {
        self.forward(x, &ForwardCtx::eval())
    }
    /// Trainable parameters with hierarchical names relative to this module (e.g.
    /// `attn.q.weight`); none by default.
    fn parameters(&self) -> Vec<(String, Param)> {
        Vec::new()
    }
    /// Non-trainable state saved with the model (e.g. batch-norm running statistics).
    fn buffers(&self) -> Vec<(String, Param)> {
        Vec::new()
    }
    /// Moves every parameter and buffer to `device`.
    fn to_device(&mut self, device: &Device) -> Result<()> {
        for (_, p) in self.parameters().into_iter().chain(self.buffers()) {
            p.to_device(device)?;
        }
        Ok(())
    }
    /// Train or eval mode (dropout, batch norm).
    fn set_train(&mut self, _train: bool) {}
    /// Called once after all micro-batches of a mini-batch ran forward: deferred updates that
    /// must not depend on the number of micro-batches (batch-norm running statistics).
    fn finish_step(&self) -> Result<()> {
        Ok(())
    }
    /// Cost of one forward on an input of `input_shape`. By default measured by running the
    /// layer once on zeros of that shape ([`measured_cost`]); a layer whose cost is cheap to
    /// compute from the shape (or whose input must not be zeros) says it here instead.
    fn cost(&self, input_shape: &[usize]) -> CostHint {
        measured_cost(self, input_shape)
    }
    /// The skips this layer pops and stashes (see [`skips`](super::skips)); none by default.
    fn skips(&self) -> Skips {
        Skips::default()
    }
    /// The forward of a layer with skips: `popped` holds the tensors of
    /// [`Module::skips`]' `pops`, in that order; the result is the output and the tensors of its
    /// `stashes`, in that order. By default the plain forward (no skips).
    fn forward_skips(&self, x: &Var, popped: &[Var], ctx: &ForwardCtx) -> Result<(Var, Vec<Var>)> {
        debug_assert!(popped.is_empty(), "{} pops no skips", self.name());
        Ok((self.forward(x, ctx)?, Vec::new()))
    }
    /// Bytes of each skip this layer stashes (in [`Module::skips`]' order) for an input of
    /// `input_shape`: what the consumer's stage holds from the producer's forward until its own
    /// backward, and what crosses the link. By default each is the size of the input (a layer
    /// that stashes its input, or something shaped like it).
    fn stash_bytes(&self, input_shape: &[usize]) -> Vec<usize> {
        let bytes = 4 * input_shape.iter().product::<usize>();
        vec![bytes; self.skips().stashes.len()]
    }
}

/// A model that builds any contiguous range of its layers on its own, so that a process of a
/// job spread over several materializes only the layers it holds (see the pipeline's
/// `Pipeline::builder_from`). Layer `i`'s initial values must depend only on the factory's
/// seed and on `i`, never on the range asked for or on the order ranges are built in, so that
/// any cut of the model starts from the same parameters, bit for bit, as the whole model built
/// at once; layers that share a tied parameter (an embedding table and a head) must each carry
/// the tie group when built alone.
pub trait ModelFactory: Send + Sync {
    /// The number of layers of the whole model.
    fn num_layers(&self) -> usize;
    /// Layers `range` of the model (indices into the whole model), in order.
    fn build_range(&self, range: std::ops::Range<usize>) -> Result<Vec<Box<dyn Module>>>;
    /// Layers `range` built only to be described (their names, shapes, skips and costs; a
    /// pipeline builds every layer of the model once so, on every rank): their values are
    /// never read, so a factory may skip making them, as a checkpoint's does not read its
    /// tensors. The layers must be those of [`ModelFactory::build_range`] in all but values.
    fn describe_range(&self, range: std::ops::Range<usize>) -> Result<Vec<Box<dyn Module>>> {
        self.build_range(range)
    }
}

/// What a layer pops (extra inputs, in this order in `forward_skips`' `popped`) and stashes
/// (extra outputs, in this order in its result), by skip name: [`Module::skips`]; the
/// [`skips`](super::skips) module pairs them up across a sequence.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Skips {
    pub pops: Vec<String>,
    pub stashes: Vec<String>,
}

impl Skips {
    pub fn is_empty(&self) -> bool {
        self.pops.is_empty() && self.stashes.is_empty()
    }
}
