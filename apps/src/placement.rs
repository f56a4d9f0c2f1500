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
    /// One line for the user, e.g. "a simulated cluster of 4 virtual devices ...".
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
            "{why}a simulated cluster of {k} virtual devices ({} GFLOP/s, {} GiB, {} GB/s links; set with --sim-*) whose arithmetic runs on the CPU; step times and bubbles are simulated",
            sim.gflops, sim.memory_gib, sim.link_gbs
        ),
    }
}

/// The stage devices of one rank of an MPI job (`--transport mpi`): as [`place`], except that
/// with `--device gpu` the rank opens one adapter only, its own (see [`rank_adapters`]), and
/// the devices of the other ranks' stages are CPU placeholders named after their rank (the
/// builder drops those stages' layers; nothing is ever placed on them).
pub fn place_rank(choice: DeviceChoice, k: usize, sim: SimSpec) -> AppResult<Placement> {
    if choice != DeviceChoice::Gpu {
        return place(choice, k, sim);
    }
    let env = |name: &str| std::env::var(name).ok();
    let (Some(world), Some(local)) = (
        rank_from_env(&env, WORLD_RANK_VARS),
        rank_from_env(&env, LOCAL_RANK_VARS),
    ) else {
        bail!(
            "--device gpu with --transport mpi: no rank in the environment ({} / {}): run under mpirun",
            WORLD_RANK_VARS.join(", "),
            LOCAL_RANK_VARS.join(", ")
        );
    };
    let (pool, note) = gpu_pool(true)?;
    let plan = rank_adapters(k, world, local, pool.len());
    let mut devices = Vec::with_capacity(k);
    let mut mine = String::new();
    for (d, slot) in plan.into_iter().enumerate() {
        devices.push(match slot {
            Some(i) => {
                let (index, name) = &pool[i];
                mine = name.clone();
                Device::wgpu(*index).context(format!("opening wgpu adapter {name}"))?
            }
            None => Device::new_cpu(&format!("rank{}", world - world % k + d)),
        });
    }
    Ok(Placement {
        devices,
        sim: None,
        description: format!(
            "{k} stages, one per rank; rank {world} (local rank {local}) on {mine}{note}, adapter {} of {}",
            local % pool.len(),
            pool.len()
        ),
    })
}

impl Placement {
    /// The device this process's layers are built on: under MPI (`rank_local`), the device of
    /// its own stage (rank r runs device r mod K), so that layers built there are not copied
    /// to it at build; in one process, the host.
    pub fn build_device(&self, rank_local: bool) -> Device {
        let env = |name: &str| std::env::var(name).ok();
        match rank_from_env(&env, WORLD_RANK_VARS) {
            Some(rank) if rank_local && !self.devices.is_empty() => {
                self.devices[rank % self.devices.len()].clone()
            }
            _ => Device::cpu(),
        }
    }
}

/// Where the launchers put a process's rank in the job (Open MPI, MPICH/Hydra).
const WORLD_RANK_VARS: &[&str] = &["OMPI_COMM_WORLD_RANK", "PMI_RANK"];
/// Where they put its rank among the processes on its host.
const LOCAL_RANK_VARS: &[&str] = &["OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"];

/// The first of `vars` that `env` holds, as a rank.
fn rank_from_env(env: &dyn Fn(&str) -> Option<String>, vars: &[&str]) -> Option<usize> {
    vars.iter().find_map(|v| env(v)?.trim().parse().ok())
}

/// Which adapter (an index into the `adapters` usable ones) each of the K devices of rank
/// `world` opens: its own device (`world % K`) gets adapter `local % adapters`, where `local`
/// is its rank among the processes on its host (so the ranks of one host spread over its
/// GPUs); the others' devices open nothing (`None`).
pub fn rank_adapters(k: usize, world: usize, local: usize, adapters: usize) -> Vec<Option<usize>> {
    (0..k)
        .map(|d| (d == world % k && adapters > 0).then(|| local % adapters))
        .collect()
}

/// The adapters stages may use, with their names: every discrete GPU when there are several,
/// else the one [`Device::best`] picks (a software adapter only when `allow_software` and
/// there is no hardware one); and a note for the user.
fn gpu_pool(allow_software: bool) -> AppResult<(Vec<(usize, String)>, &'static str)> {
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
    Ok((pool, note))
}

/// K wgpu devices. With several discrete GPUs the stages go round-robin over them; else all
/// stages share the adapter [`Device::best`] picks (one device, with its own queue, each). A
/// software adapter is used only when `allow_software` and there is no hardware one.
fn gpu_placement(k: usize, allow_software: bool) -> AppResult<Placement> {
    let (pool, note) = gpu_pool(allow_software)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_rank_opens_only_its_own_device_on_the_adapter_of_its_local_rank() {
        // 4 stages on 2 hosts with 2 GPUs each: ranks 0, 1 on host A, 2, 3 on host B.
        let expect = [
            (0, 0, [Some(0), None, None, None]),
            (1, 1, [None, Some(1), None, None]),
            (2, 0, [None, None, Some(0), None]),
            (3, 1, [None, None, None, Some(1)]),
        ];
        for (world, local, want) in expect {
            assert_eq!(rank_adapters(4, world, local, 2), want, "rank {world}");
        }
        // More ranks on a host than GPUs: local rank i -> adapter i mod count.
        assert_eq!(rank_adapters(3, 2, 2, 2), vec![None, None, Some(0)]);
        assert_eq!(rank_adapters(3, 1, 5, 3), vec![None, Some(2), None]);
        // Replicas: rank 5 of R=2 x K=3 runs device 2 of replica 1.
        assert_eq!(rank_adapters(3, 5, 1, 4), vec![None, None, Some(1)]);
        // No adapter: nothing to open (placement reports that there is no GPU).
        assert_eq!(rank_adapters(2, 0, 0, 0), vec![None, None]);
    }

    #[test]
    fn the_rank_comes_from_the_launchers_variables() {
        let env = |vars: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                vars.iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| v.to_string())
            }
        };
        let ompi = env(&[
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
        ]);
        assert_eq!(rank_from_env(&ompi, WORLD_RANK_VARS), Some(3));
        assert_eq!(rank_from_env(&ompi, LOCAL_RANK_VARS), Some(1));
        let mpich = env(&[("PMI_RANK", "2"), ("MPI_LOCALRANKID", " 0 ")]);
        assert_eq!(rank_from_env(&mpich, WORLD_RANK_VARS), Some(2));
        assert_eq!(rank_from_env(&mpich, LOCAL_RANK_VARS), Some(0));
        let none = env(&[("OMPI_COMM_WORLD_RANK", "x")]);
        assert_eq!(rank_from_env(&none, WORLD_RANK_VARS), None);
        assert_eq!(rank_from_env(&none, LOCAL_RANK_VARS), None);
    }
}
