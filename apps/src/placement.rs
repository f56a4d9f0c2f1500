//! The stage devices of `--device`: K CPU devices, K wgpu devices, or a simulated cluster.
//! Which adapter is best is the tensor crate's decision ([`Device::best`]); this module only
//! spreads the stages over what it picked.

use clap::ValueEnum;

use crate::bail;
use crate::error::{AppResult, Context};
use crate::pipeline::{LinkSpec, SimCluster};
use crate::tensor::{Device, DEVICE_ENV};

/// Where the stages run.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum DeviceChoice {
    /// The best device: K wgpu devices on the GPU if there is one, else a simulated cluster.
    Auto,
    /// K CPU devices (real arithmetic, wall-clock timeline).
    Cpu,
    /// K wgpu devices: on separate adapters when there are several GPUs, else on one adapter.
    Gpu,
    /// A simulated cluster of K virtual devices on the CPU (see --sim-*; simulated timeline).
    Sim,
}

/// The K stage devices chosen from `--device`.
pub struct Placement {
    pub devices: Vec<Device>,
    pub sim: Option<SimCluster>,
    /// One line for the user, e.g. "4 stages on a simulated cluster of 4 virtual devices ...".
    pub description: String,
}

/// The virtual devices of `--device sim` (and of `auto` without a GPU).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SimSpec {
    pub gflops: f64,
    pub memory_gib: f64,
    pub link_gbs: f64,
}

impl SimSpec {
    /// Memory of one virtual device in bytes.
    pub fn memory_bytes(&self) -> u64 {
        (self.memory_gib * (1u64 << 30) as f64) as u64
    }
}

/// Places `k` stages: see [`DeviceChoice`]. The `--sim-*` values are range-checked with the
/// other flags ([`crate::limits`]).
pub fn place(choice: DeviceChoice, k: usize, sim: SimSpec) -> AppResult<Placement> {
    match choice {
        DeviceChoice::Cpu => Ok(Placement {
            devices: (0..k)
                .map(|i| Device::new_cpu(&format!("cpu{i}")))
                .collect(),
            sim: None,
            description: format!("{k} stages on {k} CPU devices (wall-clock times)"),
        }),
        DeviceChoice::Sim => Ok(sim_placement(k, sim, "")),
        DeviceChoice::Gpu => gpu_placement(k, true),
        DeviceChoice::Auto => {
            if let Ok(spec) = std::env::var(DEVICE_ENV) {
                return env_placement(k, sim, spec.trim());
            }
            gpu_placement(k, false).or_else(|_| Ok(sim_placement(k, sim, "no GPU found: ")))
        }
    }
}

/// `--device auto` when `WGPIPE_DEVICE` is set: `cpu` means the simulated cluster, anything
/// else opens K devices as [`Device::parse`] reads it.
fn env_placement(k: usize, sim: SimSpec, spec: &str) -> AppResult<Placement> {
    match spec {
        "cpu" => Ok(sim_placement(k, sim, &format!("{DEVICE_ENV}=cpu: "))),
        "" | "auto" => {
            gpu_placement(k, false).or_else(|_| Ok(sim_placement(k, sim, "no GPU found: ")))
        }
        _ => {
            let devices = (0..k)
                .map(|_| Device::parse(spec))
                .collect::<Result<Vec<_>, _>>()
                .context(format!("{DEVICE_ENV}={spec}"))?;
            let description = format!("{k} stages on {} ({DEVICE_ENV}={spec})", devices[0].name());
            Ok(Placement {
                devices,
                sim: None,
                description,
            })
        }
    }
}

fn sim_placement(k: usize, sim: SimSpec, why: &str) -> Placement {
    let link = LinkSpec {
        bandwidth_bytes_per_sec: sim.link_gbs * 1e9,
        latency_sec: 10e-6,
    };
    let cluster = SimCluster::uniform(
        &Device::cpu(),
        k,
        sim.memory_bytes(),
        sim.gflops * 1e9,
        link,
    );
    Placement {
        devices: cluster.devices().to_vec(),
        sim: Some(cluster),
        description: format!(
            "{why}{k} stages on a simulated cluster of {k} virtual devices ({} GFLOP/s, {} GiB, {} GB/s links; set with --sim-*) whose arithmetic runs on the CPU; step times and bubbles are simulated",
            sim.gflops, sim.memory_gib, sim.link_gbs
        ),
    }
}

/// K wgpu devices. With several discrete GPUs the stages go round-robin over them; else all
/// stages share the adapter [`Device::best`] picks (one device, with its own queue, each). A
/// software adapter is used only when `allow_software` and there is no hardware one.
fn gpu_placement(k: usize, allow_software: bool) -> AppResult<Placement> {
    let all = Device::adapters();
    let discrete: Vec<_> = all
        .iter()
        .filter(|a| a.is_discrete && !a.is_software)
        .collect();
    let mut note = "";
    let pool: Vec<(usize, String)> = if discrete.len() > 1 {
        discrete.iter().map(|a| (a.index, a.name.clone())).collect()
    } else {
        let best = Device::best();
        match best.adapter_info() {
            Some(a) => vec![(a.index, a.name)],
            None => match all.iter().find(|a| a.is_software) {
                Some(a) if allow_software => {
                    note = " (a software adapter: expect it to be slower than --device cpu)";
                    vec![(a.index, a.name.clone())]
                }
                _ => bail!(
                    "--device gpu: no wgpu adapter found (no Vulkan, Metal or DX12 driver); use --device cpu or --device sim"
                ),
            },
        }
    };
    let mut devices = Vec::with_capacity(k);
    for i in 0..k {
        let (index, name) = &pool[i % pool.len()];
        devices.push(Device::wgpu(*index).context(format!("opening wgpu adapter {name}"))?);
    }
    let names: Vec<&str> = pool.iter().map(|(_, n)| n.as_str()).collect();
    let description = if pool.len() == 1 {
        format!(
            "{k} stages as {k} wgpu devices (one queue each) on {}{note}",
            names[0]
        )
    } else {
        format!(
            "{k} stages on {} GPUs: {}{note}",
            pool.len(),
            names.join(", ")
        )
    };
    Ok(Placement {
        devices,
        sim: None,
        description,
    })
}
