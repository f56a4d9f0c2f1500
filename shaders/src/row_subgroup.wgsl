// Row reductions with subgroup operations, for row kernels whose workgroup is exactly one
// subgroup (WG equal to the adapter's fixed subgroup size): no workgroup memory and no barriers,
// where row_tree.wgsl takes log2(WG) barrier rounds (each a switch per invocation on llvmpipe).
// The same functions as row_tree.wgsl; `lid` is unused. Call from uniform control flow.

fn tree_sum(lid: u32, v: f32) -> f32 {
    return subgroupAdd(v);
}

fn tree_max(lid: u32, v: f32) -> f32 {
    return subgroupMax(v);
}
