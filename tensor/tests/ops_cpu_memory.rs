//! Memory accounting through the ops: live and peak bytes follow tensors, views are free,
//! front-end temporaries are released, and a capped device refuses past its capacity and then
//! keeps working.

use wgpipe_tensor::ops::Conv2dParams;
use wgpipe_tensor::{Device, Error, Tensor};

#[test]
fn live_and_peak_follow_tensors() {
    let dev = Device::new_cpu("mem");
    assert_eq!(dev.memory_stats().live, 0);
    let a = Tensor::ones(&[10, 10], &dev).unwrap();
    assert_eq!(dev.memory_stats().live, 400);
    assert_eq!(a.storage_bytes(), 400);
    let b = a.exp().unwrap();
    assert_eq!(dev.memory_stats().live, 800);
    // Views share storage: no bytes.
    let v = b.t().unwrap().reshape(&[100]).unwrap();
    assert!(!v.shares_storage(&b));
    let view = b.permute(&[1, 0]).unwrap();
    assert!(view.shares_storage(&b));
    assert_eq!(
        dev.memory_stats().live,
        800 + 400,
        "the reshape of a transpose copies once"
    );
    drop(v);
    drop(a);
    assert_eq!(dev.memory_stats().live, 400);
    assert_eq!(dev.memory_stats().peak, 1200);
    drop((b, view));
    assert_eq!(dev.memory_stats().live, 0);
}

#[test]
fn op_temporaries_are_released() {
    let dev = Device::new_cpu("temps");
    let x = Tensor::ones(&[4, 8], &dev).unwrap();
    dev.memory().reset_peak();
    // var: mean, deviation, square and the final sum are temporaries; only the result stays.
    let v = x.t().unwrap().var(&[0], false).unwrap();
    assert_eq!(v.shape(), &[4]);
    assert_eq!(dev.memory_stats().live, 128 + 16);
    assert!(dev.memory_stats().peak > 128 + 16);
    drop(v);
    let w = Tensor::ones(&[6, 2, 3, 3], &dev).unwrap();
    let xi = Tensor::ones(&[2, 4, 5, 5], &dev).unwrap();
    let before = dev.memory_stats().live;
    let p = Conv2dParams {
        groups: 2,
        ..Default::default()
    };
    let y = xi.conv2d(&w, None, p).unwrap();
    assert_eq!(dev.memory_stats().live, before + y.storage_bytes());
    drop(y);
    assert_eq!(dev.memory_stats().live, before);
}

#[test]
fn capacity_refuses_then_keeps_working() {
    let dev = Device::new_cpu("capped");
    dev.memory().set_capacity(Some(1000));
    let a = Tensor::ones(&[200], &dev).unwrap(); // 800 bytes
    let e = a.exp().unwrap_err();
    assert_eq!(
        e,
        Error::OutOfMemory {
            device: "capped".into(),
            requested: 800,
            live: 800,
            capacity: 1000
        }
    );
    assert!(e.to_string().contains("capped"));
    assert_eq!(
        dev.memory_stats().live,
        800,
        "a refused op leaves nothing behind"
    );
    // Small ops still fit.
    let s = a.sum_all().unwrap();
    assert_eq!(s.to_scalar().unwrap(), 200.0);
    drop(s);
    // A multi-kernel op that fails half-way frees what it had made.
    let m = Tensor::ones(&[5, 5], &dev).unwrap(); // 100 bytes, 900 live
    assert!(matches!(m.var(&[0], false), Err(Error::OutOfMemory { .. })));
    assert_eq!(dev.memory_stats().live, 900);
    drop((a, m));
    assert_eq!(dev.memory_stats().live, 0);
    let b = Tensor::ones(&[100], &dev).unwrap().mul_scalar(2.0).unwrap();
    assert_eq!(b.to_vec().unwrap()[0], 2.0);
    assert!(dev.memory_stats().peak <= 1000);
    dev.memory().set_capacity(None);
    assert!(Tensor::ones(&[1000], &dev).is_ok());
}

/// A host tensor's bytes are borrowed where they lie (no copy), for contiguous views at an
/// offset too; strided views and GPU-resident tensors have none to borrow.
#[test]
fn host_bytes_borrow_contiguous_values_in_place() {
    let dev = Device::cpu();
    let values: Vec<f32> = (0..12).map(|i| i as f32 - 5.5).collect();
    let a = Tensor::from_vec(values.clone(), &[3, 4], &dev).unwrap();
    let bytes = a.host_bytes().expect("a contiguous host tensor");
    assert_eq!(bytes, bytemuck::cast_slice::<f32, u8>(&values));
    // A row further on: the same storage, from its offset.
    let row = a.narrow(0, 1, 2).unwrap();
    let row_bytes = row.host_bytes().expect("rows 1..3 are contiguous");
    assert_eq!(row_bytes, bytemuck::cast_slice::<f32, u8>(&values[4..]));
    assert_eq!(
        row_bytes.as_ptr(),
        bytes[16..].as_ptr(),
        "the row was copied"
    );
    // A column, or a transpose, is strided: nothing to borrow.
    assert!(a.narrow(1, 1, 1).unwrap().host_bytes().is_none());
    assert!(a.transpose(0, 1).unwrap().host_bytes().is_none());
    // Halves lend their 16-bit patterns.
    let h = a.to_dtype(wgpipe_tensor::DType::F16).unwrap();
    let bits: Vec<u16> = values
        .iter()
        .map(|&v| half::f16::from_f32(v).to_bits())
        .collect();
    assert_eq!(
        h.host_bytes().unwrap(),
        bytemuck::cast_slice::<u16, u8>(&bits)
    );
}
