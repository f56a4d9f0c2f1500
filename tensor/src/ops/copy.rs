//! Copies: a view made contiguous, and a tensor moved to another device.

use crate::device::Device;
use crate::dtype_policy::DTypePolicy::WidenThenRound;
use crate::error::Result;
use crate::raw::RawTensor;
use crate::tensor::Tensor;

impl Tensor {
    /// A contiguous copy, or `self` when already contiguous.
    pub fn contiguous(&self) -> Result<Tensor> {
        if self.is_contiguous() {
            return Ok(self.clone());
        }
        self.device()
            .run("contiguous", WidenThenRound, [self], |k, [x]| {
                k.contiguous(x)
            })
    }

    /// Moves (copies) the tensor to `device`. Same device: a cheap clone. Same arithmetic
    /// (virtual devices over one backing device): a device-local copy charged to `device`.
    /// Otherwise through host memory.
    pub fn to_device(&self, device: &Device) -> Result<Tensor> {
        if self.device() == device {
            return Ok(self.clone());
        }
        if self.device().same_backend(device) {
            let raw = self.raw();
            let moved = Tensor::from_raw(
                RawTensor::from_parts(
                    raw.shared_storage().clone(),
                    raw.layout().clone(),
                    device.memory(),
                ),
                device,
            );
            return device.run("contiguous", WidenThenRound, [&moved], |k, [x]| {
                k.contiguous(x)
            });
        }
        Tensor::from_vec_in(self.to_vec()?, self.shape(), self.dtype(), device)
    }
}
