//! Every `.wgsl` file of the crate, included verbatim (what the families render).

/// `NAME = "file.wgsl"` -> `pub(crate) const NAME: &str = include_str!("file.wgsl")`.
macro_rules! wgsl_files {
    ($($name:ident = $file:literal),* $(,)?) => {
        $(pub(crate) const $name: &str = include_str!($file);)*
    };
}

wgsl_files! {
    COMMON = "common.wgsl", PHILOX = "philox.wgsl",
    ELEMENTWISE = "elementwise.wgsl", COPY_STRIDED = "copy_strided.wgsl", FILL = "fill.wgsl",
    REDUCE = "reduce.wgsl", REDUCE_DIRECT = "reduce_direct.wgsl",
    REDUCE_PARTIAL = "reduce_partial.wgsl", REDUCE_FINAL = "reduce_final.wgsl",
    REDUCE_THIN = "reduce_thin.wgsl",
    SOFTMAX = "softmax.wgsl", SOFTMAX_BACKWARD = "softmax_backward.wgsl",
    LAYER_NORM = "layer_norm.wgsl", LAYER_NORM_INPUT = "layer_norm_input.wgsl",
    LAYER_NORM_RESIDUAL = "layer_norm_residual.wgsl",
    LAYER_NORM_BACKWARD = "layer_norm_backward.wgsl", ROW_TREE = "row_tree.wgsl",
    ROW_SUBGROUP = "row_subgroup.wgsl",
    CROSS_ENTROPY = "cross_entropy.wgsl", CROSS_ENTROPY_BACKWARD = "cross_entropy_backward.wgsl",
    MATMUL = "matmul.wgsl", MATMUL_SUBGROUP = "matmul_subgroup.wgsl", PACK = "pack.wgsl",
    SUM_LEADING = "sum_leading.wgsl",
    MATMUL_LOAD_SCALAR = "matmul_load_scalar.wgsl", MATMUL_LOAD_VEC_K = "matmul_load_vec_k.wgsl",
    MATMUL_LOAD_VEC_MN = "matmul_load_vec_mn.wgsl",
    MATMUL_STORE_SCALAR = "matmul_store_scalar.wgsl", MATMUL_STORE_VEC = "matmul_store_vec.wgsl",
    INDEX = "index.wgsl", SPATIAL = "spatial.wgsl", DROPOUT = "dropout.wgsl", ADAM = "adam.wgsl",
    HALF = "half.wgsl", WIDEN = "widen.wgsl", NARROW = "narrow.wgsl",
}
