//! Re-exported from the shaders crate, where the op descriptors keep their CPU reference functions.
pub(crate) use wgpipe_shaders::ops::math::*;
