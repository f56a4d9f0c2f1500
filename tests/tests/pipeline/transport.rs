//! The transport seam: a pipeline whose links go through the wire format (encoded to bytes and
//! decoded again, as between processes) trains bit-identically to one on in-process channels.

use wgpipe_pipeline::{CheckpointMode, ScheduleKind, Transport};
use wgpipe_tensor::Tensor;
use wgpipe_tests::*;

#[test]
fn loopback_wire_is_bit_identical_to_channels() {
    let (x, y) = (normal_data(&[8, 6], 1), normal_data(&[8, 3], 2));
    for (schedule, k) in [
        (ScheduleKind::GPipe, 4),
        (ScheduleKind::OneFOneB, 2),
        (ScheduleKind::ZbH1, 4),
        (ScheduleKind::ZbV, 2),
    ] {
        let run = |transport: Transport| {
            let cfg = PipeCfg {
                transport,
                ..PipeCfg::new(k, 4, CheckpointMode::ExceptLast, schedule)
            };
            let mut pipe = sim_pipeline(mlp(6, 8, 3, 11), &cfg);
            let (r, reports) = pipe_train(&mut pipe, &x, &y, &mse, 3);
            (r, reports[0].bytes_sent())
        };
        let (channels, bytes) = run(Transport::Channels);
        let (wire, wire_bytes) = run(Transport::Loopback);
        assert!(bytes > 0, "{schedule:?}: no tensor crossed a link");
        assert_eq!(wire_bytes, bytes, "{schedule:?}: bytes sent differ");
        assert!(
            wire == channels,
            "{schedule:?} K={k}: the wire changed the result by {:.3e}",
            worst_err(&wire, &channels).0
        );
    }
}

#[test]
fn loopback_wire_carries_non_finite_flags() {
    // A NaN input: under SkipStep the step is skipped and names stage 0 on either transport
    // (the receivers learn through the header's flag that the NaN is not their doing).
    let mut x = normal_data(&[8, 6], 1).to_vec().unwrap();
    x[7] = f32::NAN;
    let x = Tensor::from_vec(x, &[8, 6], &wgpipe_tensor::Device::cpu()).unwrap();
    let y = normal_data(&[8, 3], 2);
    let cfg = PipeCfg {
        transport: Transport::Loopback,
        ..PipeCfg::new(2, 2, CheckpointMode::ExceptLast, ScheduleKind::GPipe)
    };
    let mut pipe = sim_pipeline(mlp(6, 8, 3, 11), &cfg);
    pipe.set_non_finite(wgpipe_pipeline::NonFinite::SkipStep);
    let r = pipe.train_step(&x, &y, &mse).unwrap();
    let at = r.skipped.expect("the NaN step is skipped");
    assert_eq!((at.stage, at.micro_batch), (0, 0), "{at:?}");
}
