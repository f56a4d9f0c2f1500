use std::time::Instant;
use wgpipe::pipeline::exec::transport::wire;
use wgpipe::pipeline::Link;
use wgpipe::tensor::{Device, Tensor};
fn main() {
    for &bytes in &[1usize << 20, 16 << 20] {
        let n = bytes / 4;
        let t = Tensor::full(&[n], 0.5, &Device::cpu()).unwrap();
        let link = Link {
            from: 0,
            to: 1,
            grad: false,
            skip: None,
        };
        for _ in 0..3 {
            let t0 = Instant::now();
            let v = t.to_vec().unwrap();
            let t1 = Instant::now();
            let f = wire::encode(
                &wire::Header {
                    kind: wire::MsgKind::Activation,
                    step: 1,
                    link,
                    micro_batch: 0,
                    finite: true,
                    dtype: wire::WireDtype::F32,
                    shape: vec![n],
                },
                v,
            );
            let t2 = Instant::now();
            let mut r = wire::Frame::for_receive(f.bytes().len());
            let t3 = Instant::now();
            r.bytes_mut().copy_from_slice(f.bytes());
            let t4 = Instant::now();
            let (h, v) = wire::decode_frame(r).unwrap();
            let back = wire::tensor_of(&h, v).unwrap();
            let t5 = Instant::now();
            drop(back);
            drop(f);
            println!("{bytes}: to_vec {:?} seal {:?} alloc {:?} copy(MPI stand-in) {:?} decode+tensor {:?}", t1-t0, t2-t1, t3-t2, t4-t3, t5-t4);
        }
    }
}
