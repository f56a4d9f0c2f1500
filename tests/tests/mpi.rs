//! Stages in separate processes over MPI (feature `mpi`): `mpirun` runs the `mpi_worker` binary,
//! one device per rank, and each rank's losses and parameters are compared with the in-process
//! pipeline (the same K, M and schedule) trained here: bit-identical, since every rank does the
//! same arithmetic on the same values; and a fault on one rank makes every rank fail at once,
//! leaving the parameters as before.
//!
//! Needs `mpirun` (Open MPI) on PATH; run with `cargo test -p wgpipe-tests --features mpi --test mpi`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use serde_json::Value;
use wgpipe_pipeline::ScheduleKind;
use wgpipe_tests::*;

/// `mpirun -np <ranks>`, ready for the program and its arguments.
fn mpirun_np(ranks: usize) -> Command {
    static RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let mut cmd = Command::new("mpirun");
    // Root in CI containers; more ranks than cores on small machines.
    cmd.args(["--allow-run-as-root", "--oversubscribe", "-np"])
        .arg(ranks.to_string());
    // Each mpirun its own session directory: the tests run side by side, and Open MPI 4's
    // shared one (`$TMPDIR/ompi.<host>.<uid>`) is removed by one run while another creates its
    // own inside it ("orte_session_dir failed", seen once in CI). Short, for its sockets' paths.
    let run = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = std::env::temp_dir().join(format!("wo{}-{run}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    cmd.env("TMPDIR", &tmp);
    cmd
}

/// Starts `job` under `mpirun -np <ranks>`, writing into `dir`, with `env` set for every rank
/// and its output piped (read it with [`output_within`]).
fn spawn_job(job: &MpiJob, ranks: usize, dir: &Path, env: &[(&str, &str)]) -> Child {
    let mut cmd = mpirun_np(ranks);
    for (name, value) in env {
        cmd.env(name, value).args(["-x", name]);
    }
    cmd.arg(env!("CARGO_BIN_EXE_mpi_worker"))
        .args(job.args())
        .arg(dir)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run mpirun (is Open MPI installed?): {e}"))
}

/// An empty folder of this test process for `name`.
fn fresh_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("wgpipe-mpi-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs `job` under `mpirun -np <ranks>` and returns each rank's results, by rank.
fn mpirun(job: &MpiJob, ranks: usize, tag: &str) -> Vec<Value> {
    mpirun_with(job, ranks, tag, &[])
}

/// [`mpirun`] with environment variables for every rank.
fn mpirun_with(job: &MpiJob, ranks: usize, tag: &str, env: &[(&str, &str)]) -> Vec<Value> {
    let dir = fresh_dir(&tag.replace([' ', ','], "-"));
    let mut cmd = mpirun_np(ranks);
    for (name, value) in env {
        cmd.env(name, value).args(["-x", name]);
    }
    cmd.arg(env!("CARGO_BIN_EXE_mpi_worker"))
        .args(job.args())
        .arg(&dir);
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run mpirun (is Open MPI installed?): {e}"));
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            panic!("{tag}: mpirun -np {ranks} still running after 120 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(
        status.success(),
        "{tag}: mpirun -np {ranks} failed: {status}"
    );
    let out = (0..ranks)
        .map(|r| {
            let p: PathBuf = dir.join(format!("rank{r}.json"));
            let text = std::fs::read_to_string(&p)
                .unwrap_or_else(|e| panic!("{tag}: rank {r} wrote no results ({e})"));
            serde_json::from_str(&text).unwrap()
        })
        .collect();
    std::fs::remove_dir_all(&dir).unwrap();
    out
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

/// What the ranks trained, put together: the losses (the same on every rank) and every
/// parameter, from the rank that runs its stage (each parameter must come from one rank).
fn gather(ranks: &[Value], tag: &str) -> RunResult {
    let losses = floats(&ranks[0]["losses"]);
    let mut params: HashMap<String, Vec<f32>> = HashMap::new();
    for (r, v) in ranks.iter().enumerate() {
        assert_eq!(
            floats(&v["losses"]),
            losses,
            "{tag}: rank {r}'s losses differ"
        );
        assert_eq!(
            v["errors"].as_array().unwrap().len(),
            0,
            "{tag}: rank {r}: {}",
            v["errors"]
        );
        for (name, values) in v["params"].as_object().unwrap() {
            let old = params.insert(name.clone(), floats(values));
            assert!(old.is_none(), "{tag}: {name} on two ranks");
        }
    }
    let mut params: Vec<_> = params.into_iter().collect();
    params.sort_by(|a, b| a.0.cmp(&b.0));
    RunResult { losses, params }
}

/// The same job in one process (channels), trained for `steps` steps.
fn in_process(job: &MpiJob, steps: usize) -> RunResult {
    let (x, y) = MpiJob::data();
    let mut pipe = sim_pipeline(MpiJob::model().0, &job.cfg());
    pipe_train(&mut pipe, &x, &y, &mse, steps).0
}

/// Each rank holds only its own stages: its parameters are its device's share of the model
/// (the stages placed on it in the same pipeline built in one process), on its own device
/// (the memory counters of the others' devices show nothing), and so is its optimizer state
/// (SGD with momentum: one buffer per parameter). The step report, gathered, shows every
/// device's share.
fn each_rank_holds_its_share(job: &MpiJob, ranks: &[Value], tag: &str) {
    let one = sim_pipeline(MpiJob::model().0, &job.cfg());
    let mut share = vec![0usize; job.k];
    for s in one.stages() {
        share[one.schedule().placement[s.index]] += 4 * s.num_params();
    }
    let whole: usize = one
        .named_parameters()
        .iter()
        .map(|(_, p)| 4 * p.value().numel())
        .sum();
    assert_eq!(share.iter().sum::<usize>(), whole, "{tag}");
    for (r, v) in ranks.iter().enumerate() {
        let me = r % job.k;
        let mut only_mine = vec![0u64; job.k];
        only_mine[me] = share[me] as u64;
        assert_eq!(v["held_param_bytes"], share[me] as u64, "{tag}: rank {r}");
        for key in [
            "built_param_bytes",
            "final_param_bytes",
            "final_optimizer_bytes",
        ] {
            let got: Vec<u64> = v[key]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b.as_u64().unwrap())
                .collect();
            assert_eq!(got, only_mine, "{tag}: rank {r}'s {key}");
        }
        // The report (the same on every rank) counts each device where it is.
        let reported: Vec<usize> = v["report_param_bytes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b.as_u64().unwrap() as usize)
            .collect();
        assert_eq!(reported, share, "{tag}: rank {r}'s report");
        println!(
            "{tag}: rank {r} holds {} of the model's {whole} parameter bytes",
            share[me]
        );
    }
}

#[test]
fn mpi_ranks_train_bit_identically_to_one_process() {
    for (schedule, k) in [
        (ScheduleKind::GPipe, 2),
        (ScheduleKind::GPipe, 4),
        (ScheduleKind::OneFOneB, 2),
        (ScheduleKind::OneFOneB, 4),
        (ScheduleKind::ZbH1, 2),
        (ScheduleKind::ZbH1, 4),
        // Two virtual stages per rank.
        (ScheduleKind::ZbV, 2),
    ] {
        let job = MpiJob::new(schedule, k);
        let tag = format!("{schedule:?}-np{k}");
        let ranks = mpirun(&job, k, &tag);
        each_rank_holds_its_share(&job, &ranks, &tag);
        let got = gather(&ranks, &tag);
        let want = in_process(&job, job.steps);
        assert_eq!(
            got.params.len(),
            want.params.len(),
            "{tag}: parameters missing"
        );
        assert!(
            got == want,
            "{tag}: differs from one process by {:.3e} at {}",
            worst_err(&got, &want).0,
            worst_err(&got, &want).1
        );
        println!("{tag}: {} steps bit-identical to one process", job.steps);
    }
}

#[test]
fn two_replicas_of_two_ranks_equal_in_process_data_parallelism() {
    let job = MpiJob {
        replicas: 2,
        m: 3,
        ..MpiJob::new(ScheduleKind::OneFOneB, 2)
    };
    let ranks = mpirun(&job, 4, "dp");
    // Replica 1 (ranks 2, 3) holds the same parameters as replica 0 (ranks 0, 1), bit for bit.
    let replica = |r: usize| gather(&ranks[2 * r..2 * r + 2], &format!("replica {r}"));
    let (r0, r1) = (replica(0), replica(1));
    assert!(r0 == r1, "the replicas differ");
    let (x, y) = MpiJob::data();
    let mut dp = dp_sim_pipeline(2, || MpiJob::model().0, &job.cfg()).unwrap();
    let (want, _) = pipe_train(&mut dp, &x, &y, &mse, job.steps);
    assert!(
        r0 == want,
        "MPI data parallelism differs from in-process by {:.3e}",
        worst_err(&r0, &want).0
    );
    // And one pipeline on the whole mini-batch, up to the order of the sums.
    let one = in_process(
        &MpiJob {
            m: 6,
            ..job.clone()
        },
        job.steps,
    );
    let (e, at) = worst_err(&r0, &one);
    assert!(e <= 1e-5, "{e:.3e} at {at}");
}

/// Three replicas of two ranks (R = 3: the buckets' chunks do not divide evenly), reduced by
/// MPI's collectives with the reduction overlapping the backward and without it: every
/// replica, both ways and in a second run, holds the in-process replicas' bits.
#[test]
fn replicas_reduced_by_mpi_collectives_equal_in_process_bits_with_or_without_overlap() {
    let job = MpiJob {
        replicas: 3,
        m: 2,
        steps: 2,
        ..MpiJob::new(ScheduleKind::ZbH1, 2)
    };
    let (x, y) = MpiJob::data();
    let mut dp = dp_sim_pipeline(3, || MpiJob::model().0, &job.cfg()).unwrap();
    let (want, _) = pipe_train(&mut dp, &x, &y, &mse, job.steps);
    for (overlap, run) in [("1", 0), ("0", 0), ("1", 1)] {
        let tag = format!("overlap {overlap}, run {run}");
        let ranks = mpirun_with(&job, 6, &tag, &[("WGPIPE_MPI_OVERLAP", overlap)]);
        for r in 0..3 {
            let got = gather(&ranks[2 * r..2 * r + 2], &format!("{tag}, replica {r}"));
            assert!(
                got == want,
                "{tag}: replica {r} differs from in-process replicas by {:.3e}",
                worst_err(&got, &want).0
            );
        }
    }
}

#[test]
fn a_fault_on_one_rank_fails_every_rank_at_once_and_changes_nothing() {
    for (fault, k) in [
        (MpiFault::Error, 2),
        (MpiFault::Panic, 4),
        (MpiFault::OutOfMemory, 2),
    ] {
        // Step 1 of 4 fails on the last rank (which holds the Fault layer).
        let job = MpiJob {
            steps: 4,
            fault: Some((k - 1, 1, fault)),
            ..MpiJob::new(ScheduleKind::OneFOneB, k)
        };
        let tag = format!("fault-{fault:?}-np{k}");
        let ranks = mpirun(&job, k, &tag);
        for (r, v) in ranks.iter().enumerate() {
            let errors = v["errors"].as_array().unwrap();
            assert_eq!(errors.len(), 1, "{tag}: rank {r}: {errors:?}");
            let e = &errors[0];
            let text = e["text"].as_str().unwrap();
            assert_eq!(e["step"], 1);
            let secs = e["secs"].as_f64().unwrap();
            assert!(secs < 1.0, "{tag}: rank {r} took {secs:.3} s to fail");
            let want: &[&str] = match fault {
                MpiFault::Error => &["micro-batch 1", "Fault", "injected error"],
                MpiFault::Panic => &["micro-batch 1", "Fault", "injected panic"],
                // The first allocation past the cap, whichever it is: the bytes asked for
                // and the room there was.
                _ => &["out of memory", "asked for", "bytes live and a capacity of"],
            };
            assert!(
                text.contains(&format!("rank {}", k - 1))
                    && text.contains(&format!("stage {}", k - 1))
                    && want.iter().all(|w| text.contains(w)),
                "{tag}: rank {r}: {text}"
            );
            println!("{tag}: rank {r} failed in {:.1} ms: {text}", secs * 1e3);
        }
        // The failed step changed nothing: the run equals 3 unfailed steps.
        let mut trained: Vec<Value> = ranks.clone();
        for v in &mut trained {
            v["errors"] = Value::Array(vec![]);
        }
        let got = gather(&trained, &tag);
        let want = in_process(&job, 3);
        assert!(got == want, "{tag}: the failed step left a trace");
    }
}

/// Loss scaling across processes: an overflow on the last rank (the Fault layer's output at
/// step 1, micro-batch 1) skips that step on every rank, learned from the step's outcome the
/// ranks already exchange (no further message): every rank lists the same skipped step, ends
/// at the same scale (1024, halved at step 1, doubled after steps 2 and 3), and holds the
/// parameters of the same run in one process, bit for bit.
#[test]
fn an_overflow_on_one_rank_skips_the_step_on_every_rank() {
    for schedule in [ScheduleKind::OneFOneB, ScheduleKind::ZbH1] {
        let k = 2;
        let job = MpiJob {
            steps: 4,
            fault: Some((k - 1, 1, MpiFault::Overflow)),
            ..MpiJob::new(schedule, k)
        };
        let tag = format!("overflow-{schedule:?}-np{k}");
        let ranks = mpirun(&job, k, &tag);
        for (r, v) in ranks.iter().enumerate() {
            assert_eq!(v["skipped"], serde_json::json!([1]), "{tag}: rank {r}");
            assert_eq!(v["loss_scale"], 1024.0, "{tag}: rank {r}");
        }
        let got = gather(&ranks, &tag);

        // The same run in one process, with the same overflow.
        let (x, y) = MpiJob::data();
        let (layers, fault) = MpiJob::model();
        let mut pipe = sim_pipeline(layers, &job.cfg());
        let mut losses = Vec::new();
        for step in 0..job.steps {
            fault.lock().unwrap().armed = (step == 1).then_some((FaultKind::Overflow, 1));
            let r = pipe.train_step(&x, &y, &mse).unwrap();
            pipe.optimizer_step().unwrap();
            assert_eq!(r.skipped.is_some(), step == 1, "{tag}: step {step}");
            if r.skipped.is_none() {
                losses.push(r.loss);
            }
        }
        let scaler = pipe.loss_scaler().unwrap();
        assert_eq!((scaler.scale, scaler.skipped_steps), (1024.0, 1), "{tag}");
        let want = RunResult {
            losses,
            params: snapshot(&pipe.named_parameters()),
        };
        assert!(got == want, "{tag}: the ranks differ from one process");
        println!("{tag}: step 1 skipped on every rank, 3 steps bit-identical to one process");
    }
}

#[test]
fn an_optimizer_failure_on_one_rank_fails_every_rank_and_changes_nothing() {
    // Step 1's optimizer step finds no room on rank 1's device; the worker retries it.
    let job = MpiJob {
        steps: 3,
        fault: Some((1, 1, MpiFault::Optimizer)),
        ..MpiJob::new(ScheduleKind::OneFOneB, 2)
    };
    let tag = "optimizer-fault";
    let ranks = mpirun(&job, 2, tag);
    // What every parameter holds after step 0, before step 1's update.
    let before: HashMap<String, Vec<f32>> = in_process(&job, 1).params.into_iter().collect();
    for (r, v) in ranks.iter().enumerate() {
        let errors = v["errors"].as_array().unwrap();
        assert_eq!(errors.len(), 1, "{tag}: rank {r}: {errors:?}");
        let e = &errors[0];
        let text = e["text"].as_str().unwrap();
        assert_eq!((&e["step"], &e["phase"]), (&1.into(), &"optimizer".into()));
        assert!(
            ["rank 1", "stage 1", "optimizer step", "out of memory"]
                .iter()
                .all(|w| text.contains(w)),
            "{tag}: rank {r}: {text}"
        );
        // Every rank rolled its own stages back, the one that did not fail included.
        let after = e["params_after"].as_object().unwrap();
        assert!(!after.is_empty());
        for (name, values) in after {
            assert_eq!(
                floats(values),
                before[name],
                "{tag}: rank {r} changed {name}"
            );
        }
        println!("{tag}: rank {r}: {text}");
    }
    // The retried step applied the update once: the run equals an unfailed one.
    let mut trained: Vec<Value> = ranks.clone();
    for v in &mut trained {
        v["errors"] = Value::Array(vec![]);
    }
    let got = gather(&trained, tag);
    assert!(
        got == in_process(&job, 3),
        "{tag}: differs from an unfailed run"
    );
}

#[test]
fn a_rank_that_dies_ends_the_job_in_bounded_time_naming_it() {
    // Rank 1 calls abort() in the forward of micro-batch 1 of step 1.
    let job = MpiJob {
        steps: 3,
        fault: Some((1, 1, MpiFault::Abort)),
        ..MpiJob::new(ScheduleKind::OneFOneB, 2)
    };
    let dir = fresh_dir("abort");
    let start = Instant::now();
    let child = spawn_job(&job, 2, &dir, &[]);
    // The bound: well under the peer time limit (60 s), far over what it takes (about 1 s).
    let (ok, text, secs) = output_within(child, start, Duration::from_secs(20), "rank 1 died");
    assert!(!ok, "the job succeeded: {text}");
    assert!(
        text.contains("rank 1") && text.contains("signal 6"),
        "the message does not name the dead rank: {text}"
    );
    // No rank finished the job.
    assert!(!dir.join("rank0.json").exists() && !dir.join("rank1.json").exists());
    println!("the job ended {secs:.1} s after start: {}", text.trim());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_rank_that_hangs_is_taken_for_dead_within_the_peer_limit_naming_it() {
    // Rank 1 stops (SIGSTOP, every thread frozen) in the forward of micro-batch 1 of step 1;
    // mpirun sees nothing wrong, so only the heartbeats tell rank 0.
    hang(1, 1);
}

/// With two replicas: rank 3 (device 1 of replica 1) hangs while rank 1 (device 1 of replica
/// 0) finishes the step and starts its gradient bucket, whose collective waits for rank 3.
/// Every live rank (the one with the reduction in flight among them) fails naming rank 3.
#[test]
fn a_rank_that_hangs_during_a_reduction_is_named_by_every_other_rank() {
    hang(2, 3);
}

/// Rank `hung` of a K=2 x `replicas` job stops at step 1; every other rank must fail steps 1
/// and 2 naming it, within the peer limit, and end MPI at once.
fn hang(replicas: usize, hung: usize) {
    let job = MpiJob {
        steps: 3,
        replicas,
        fault: Some((hung, 1, MpiFault::Stop)),
        ..MpiJob::new(ScheduleKind::OneFOneB, 2)
    };
    let ranks = 2 * replicas;
    let dir = fresh_dir(&format!("stop{replicas}"));
    let limit = 2.0;
    let mut child = mpirun_np(ranks)
        .arg("-x")
        .arg(format!("WGPIPE_MPI_PEER_TIMEOUT={limit}"))
        .arg(env!("CARGO_BIN_EXE_mpi_worker"))
        .args(job.args())
        .arg(&dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let live: Vec<usize> = (0..ranks).filter(|&r| r != hung).collect();
    let result = |r: usize| dir.join(format!("rank{r}.json"));
    while !live.iter().all(|&r| result(r).exists()) && start.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(50));
    }
    // The hung rank is ended by hand either way (a stopped process takes SIGKILL), then mpirun.
    if let Ok(pid) = std::fs::read_to_string(dir.join(format!("rank{hung}.pid"))) {
        let _ = Command::new("kill").args(["-KILL", pid.trim()]).status();
    }
    let bound = Instant::now();
    while child.try_wait().unwrap().is_none() && bound.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    let mut finished = 0;
    for r in live {
        assert!(
            result(r).exists(),
            "rank {r} never finished while rank {hung} hung"
        );
        let v: Value = serde_json::from_str(&std::fs::read_to_string(result(r)).unwrap()).unwrap();
        // Step 0 trained; steps 1 and 2 failed, naming the hung rank, step 1 within the limit
        // and a heartbeat or two (and step 2 at once).
        assert_eq!(floats(&v["losses"]).len(), 1, "rank {r}");
        let errors = v["errors"].as_array().unwrap();
        assert_eq!(errors.len(), 2, "rank {r}: {errors:?}");
        for (e, most) in errors.iter().zip([limit + 1.5, 0.5]) {
            let text = e["text"].as_str().unwrap();
            let secs = e["secs"].as_f64().unwrap();
            assert!(
                text.contains(&format!("rank {hung} has sent nothing"))
                    && text.contains("taken for dead"),
                "rank {r}: {text}"
            );
            assert!(
                secs < most,
                "rank {r}: step {} failed after {secs:.2} s: {text}",
                e["step"]
            );
            println!(
                "rank {r}: step {} failed after {secs:.2} s: {text}",
                e["step"]
            );
        }
        // Ending MPI does not wait on sends to the dead rank (timed by the ranks that got that
        // far before the first one out ended the job).
        if let Some(finish) = v["finish_secs"].as_f64() {
            finished += 1;
            assert!(finish < 1.0, "rank {r} took {finish:.2} s to end MPI");
        }
    }
    assert!(finished >= 1, "no rank timed the end of MPI");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_checkpoint_gathered_from_the_ranks_resumes_bit_exactly_under_mpi_and_in_one_process() {
    let dir = fresh_dir("ckpt");
    let base = MpiJob {
        steps: 4,
        ..MpiJob::new(ScheduleKind::OneFOneB, 2)
    };
    let straight = gather(&mpirun(&base, 2, "ckpt-straight"), "straight");
    // Saves after 2 steps into its output folder (removed after the run): keep a copy.
    let ckpt = dir.join("after2.safetensors");
    let saving = MpiJob {
        save_at: Some(2),
        steps: 3,
        ..base.clone()
    };
    {
        // mpirun() removes its folder, so run it by hand here.
        let out = dir.join("saving");
        std::fs::create_dir_all(&out).unwrap();
        let status = mpirun_np(2)
            .arg(env!("CARGO_BIN_EXE_mpi_worker"))
            .args(saving.args())
            .arg(&out)
            .status()
            .unwrap();
        assert!(status.success());
        std::fs::copy(out.join("ckpt.safetensors"), &ckpt).unwrap();
    }
    let resumed_job = MpiJob {
        steps: 2,
        resume: Some(ckpt.clone()),
        ..base.clone()
    };
    let resumed = gather(&mpirun(&resumed_job, 2, "ckpt-resumed"), "resumed");
    assert_eq!(
        resumed.losses,
        straight.losses[2..],
        "losses after resuming under MPI"
    );
    assert!(
        resumed.params == straight.params,
        "parameters after resuming under MPI"
    );
    // In one process, from the same file.
    let (x, y) = MpiJob::data();
    let mut one = sim_pipeline(MpiJob::model().0, &base.cfg());
    one.load(&ckpt, &wgpipe_pipeline::LoadOptions::default())
        .unwrap();
    let (got, _) = pipe_train(&mut one, &x, &y, &mse, 2);
    assert_eq!(
        got.losses,
        straight.losses[2..],
        "losses after resuming in one process"
    );
    assert!(
        got.params == straight.params,
        "parameters after resuming in one process"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A sharded checkpoint saved under `mpirun -np 8` (K = 4 x R = 2: each rank of replica 0
/// writes its own stages, nothing is gathered, rank 0 writes the index) resumes in one process
/// with K = 1 and K = 2, and under `mpirun` with K = 2 (-np 4) and K = 1 (-np 2), bit for bit as
/// the uninterrupted run.
#[test]
fn a_sharded_checkpoint_of_4x2_ranks_resumes_with_k_1_and_2_in_one_process_and_under_mpirun() {
    let dir = fresh_dir("shards");
    let base = MpiJob {
        replicas: 2,
        ..MpiJob::new(ScheduleKind::OneFOneB, 4)
    };
    // The uninterrupted run, in one process (the ranks train bit-identically to it, see
    // two_replicas_of_two_ranks_equal_in_process_data_parallelism).
    let (x, y) = MpiJob::data();
    let mut straight = dp_sim_pipeline(2, || MpiJob::model().0, &base.cfg()).unwrap();
    let (at2, _) = pipe_train(&mut straight, &x, &y, &mse, 2);
    let (after, _) = pipe_train(&mut straight, &x, &y, &mse, 2);
    let saving = MpiJob {
        save_at: Some(2),
        sharded: true,
        steps: 3,
        ..base.clone()
    };
    let start = Instant::now();
    let child = spawn_job(&saving, 8, &dir, &[]);
    let (ok, out, _) = output_within(child, start, Duration::from_secs(120), "sharded save");
    assert!(ok, "{out}");
    let ckpt = dir.join("ckpt");
    let mut files: Vec<String> = std::fs::read_dir(&ckpt)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .collect();
    files.sort();
    let mut want: Vec<String> = (1..=4)
        .map(|i| format!("model-save1-{i:05}-of-00004.safetensors"))
        .collect();
    want.push(wgpipe_pipeline::INDEX_FILE.into());
    assert_eq!(
        files, want,
        "one shard per device of replica 0, and the index"
    );
    for k in [1, 2] {
        // In one process.
        let cfg = MpiJob { k, ..base.clone() }.cfg();
        let mut one = dp_sim_pipeline(2, || MpiJob::model().0, &cfg).unwrap();
        let restored = one
            .load(&ckpt, &wgpipe_pipeline::LoadOptions::default())
            .unwrap();
        assert_eq!(restored.step, 2);
        assert!(
            snapshot(&one.named_parameters()) == at2.params,
            "K = {k}: parameters loaded in one process"
        );
        let (got, _) = pipe_train(&mut one, &x, &y, &mse, 2);
        assert_eq!(got.losses, after.losses, "K = {k}: losses in one process");
        assert!(
            got.params == after.params,
            "K = {k}: parameters in one process"
        );
        // Under mpirun, K x R = 2 ranks: each reads the shards of its stages.
        let resumed = MpiJob {
            k,
            steps: 2,
            resume: Some(ckpt.clone()),
            ..base.clone()
        };
        let ranks = mpirun(&resumed, 2 * k, &format!("shards-resumed-{k}"));
        let r0 = gather(&ranks[..k], "resumed replica 0");
        assert_eq!(r0.losses, after.losses, "K = {k}: losses under mpirun");
        assert!(
            r0.params == after.params,
            "K = {k}: parameters under mpirun"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A sharded save whose shard cannot be written on one rank (a folder in its place) fails on
/// every rank, naming the shard, and writes no index: the folder holds no checkpoint.
#[test]
fn a_sharded_save_that_fails_on_one_rank_fails_on_every_rank_and_writes_no_index() {
    let dir = fresh_dir("shards-fail");
    let job = MpiJob {
        save_at: Some(1),
        sharded: true,
        steps: 2,
        ..MpiJob::new(ScheduleKind::OneFOneB, 2)
    };
    let blocked = "model-save1-00002-of-00002.safetensors";
    std::fs::create_dir_all(dir.join("ckpt").join(blocked)).unwrap();
    let start = Instant::now();
    let child = spawn_job(&job, 2, &dir, &[]);
    let (ok, out, _) = output_within(child, start, Duration::from_secs(120), "failing save");
    assert!(!ok, "the job succeeded: {out}");
    // Each rank's report anywhere (mpirun can interleave the ranks' lines), both naming the
    // shard.
    for rank in 0..2 {
        assert!(
            out.contains(&format!("rank {rank}: ")),
            "rank {rank} reported no error: {out}"
        );
    }
    assert!(
        out.matches(blocked).count() >= 2,
        "not every rank names {blocked}: {out}"
    );
    assert!(
        !dir.join("ckpt").join(wgpipe_pipeline::INDEX_FILE).exists(),
        "an index was written"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A load that one rank cannot do (the shard of its stages holds a NaN; the other rank never
/// reads it) fails on every rank, naming the tensor, before any rank changes.
#[test]
fn a_load_that_fails_on_one_rank_fails_on_every_rank() {
    let dir = fresh_dir("shards-load");
    let job = MpiJob {
        save_at: Some(1),
        sharded: true,
        steps: 2,
        ..MpiJob::new(ScheduleKind::OneFOneB, 2)
    };
    let run = |job: &MpiJob, out: &Path| {
        std::fs::create_dir_all(out).unwrap();
        let start = Instant::now();
        let child = spawn_job(job, 2, out, &[]);
        output_within(child, start, Duration::from_secs(120), "job")
    };
    let (ok, out, _) = run(&job, &dir.join("save"));
    assert!(ok, "{out}");
    let ckpt = dir.join("save").join("ckpt");
    // A NaN in the first tensor of the second shard (device 1's stages).
    let shard = ckpt.join("model-save1-00002-of-00002.safetensors");
    let cpu = wgpipe_tensor::Device::cpu();
    let mut f = wgpipe_autograd::serialize::load_file(&shard, &cpu).unwrap();
    let (name, t) = &mut f.tensors[0];
    let poisoned = name.clone();
    *t = wgpipe_tensor::Tensor::from_vec(vec![f32::NAN; t.numel()], t.shape(), &cpu).unwrap();
    wgpipe_autograd::serialize::save_tensors(&shard, &f.tensors, &f.metadata).unwrap();
    let resumed = MpiJob {
        save_at: None,
        sharded: false,
        resume: Some(ckpt),
        ..job.clone()
    };
    let (ok, out, _) = run(&resumed, &dir.join("resume"));
    assert!(!ok, "the job succeeded: {out}");
    // mpirun forwards each rank's stderr in chunks, so two ranks' lines can interleave: each
    // rank's report is looked for anywhere, and both name the poisoned tensor.
    for rank in 0..2 {
        assert!(
            out.contains(&format!("rank {rank}: ")),
            "rank {rank} reported no error: {out}"
        );
    }
    assert!(
        out.matches(poisoned.as_str()).count() >= 2,
        "not every rank names {poisoned}: {out}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Activations and gradients large enough to leave from their tensors' storage (the values
/// and then the rest of the message, joined on arrival): training, evaluation and sampling
/// under mpirun give one process's bits.
#[test]
fn large_activations_cross_ranks_from_their_storage_and_train_like_one_process() {
    let dir = fresh_dir("large-messages");
    // Micro-batches of 8 sequences of 64 positions of d_model 64: 128 KiB per activation.
    let (rows, seq, d) = (8, 64, 64);
    assert!(
        rows * seq * d * 4 >= wgpipe_pipeline::exec::transport::wire::SPLIT_FROM,
        "the messages of this test no longer take the split path"
    );
    let mut flags = example_flags(d, seq, 2 * rows);
    flags.extend(["--steps", "3", "--sample-len", "4", "--schedule", "1f1b"].map(String::from));
    let summary = dir.join("np2.json");
    let out = mpirun_np(2)
        .arg(env!("CARGO_BIN_EXE_mpi_example"))
        .arg(&summary)
        .args(&flags)
        .args(["--transport", "mpi"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    same_as_one_process(&summary, flags);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The summary that `program` (an example as one rank) writes, run by `mpirun -np 2` with
/// `flags` and `--transport mpi`, into `dir`; fails the test, with the job's output, if it fails.
fn summary_over_mpi(program: &str, dir: &Path, flags: Vec<String>) -> Value {
    let summary = dir.join("np2.json");
    let out = mpirun_np(2)
        .arg(program)
        .arg(&summary)
        .args(flags)
        .args(["--transport", "mpi"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(&std::fs::read_to_string(&summary).unwrap()).unwrap()
}

/// Checks the summary an MPI job of `mpi_example` wrote against the same flags run in this
/// process: the same losses, held-out loss and sample, bit for bit.
fn same_as_one_process(summary: &Path, flags: Vec<String>) {
    let got: Value = serde_json::from_str(&std::fs::read_to_string(summary).unwrap()).unwrap();
    let args = wgpipe_apps::train_transformer::TransformerArgs::parse_from_args(flags).unwrap();
    let want =
        wgpipe_apps::train_transformer::run_with(args, &std::sync::atomic::AtomicBool::new(false))
            .unwrap();
    assert_eq!(floats(&got["losses"]), want.losses);
    assert_eq!(got["eval_loss"].as_f64().unwrap() as f32, want.eval_loss);
    assert_eq!(got["sample"].as_str().unwrap(), want.sample);
}

/// The flags of a small transformer example run on a simulated 2-device pipeline.
fn tiny_example_flags() -> Vec<String> {
    example_flags(16, 16, 8)
}

/// The flags of a 2-block transformer example of width `d_model` over sequences of `seq_len`,
/// `batch` of them per step in 2 micro-batches, on a simulated 2-device pipeline.
fn example_flags(d_model: usize, seq_len: usize, batch: usize) -> Vec<String> {
    let mut v: Vec<String> = [
        "--quiet",
        "--device",
        "sim",
        "--stages",
        "2",
        "--micro-batches",
        "2",
        "--layers",
        "2",
        "--heads",
        "2",
    ]
    .map(String::from)
    .to_vec();
    for (flag, value) in [
        ("--d-model", d_model),
        ("--seq-len", seq_len),
        ("--batch", batch),
    ] {
        v.extend([flag.to_string(), value.to_string()]);
    }
    v
}

#[test]
fn the_transformer_example_under_mpirun_trains_like_one_process_and_only_rank_0_writes() {
    let dir = fresh_dir("example");
    let flags = |name: &str, extra: &[&str]| -> Vec<String> {
        let mut v = tiny_example_flags();
        v.extend(
            [
                "--sample-len",
                "8",
                "--steps",
                "3",
                "--dropout",
                "0.1",
                "--schedule",
                "1f1b",
                // Tied embeddings (the default): the first and last stage, on different ranks,
                // sum their copies' gradients over MPI.
            ]
            .map(|s| s.to_string()),
        );
        for (flag, file) in [("--trace", "trace.json"), ("--timeline", "timeline.svg")] {
            v.push(flag.into());
            v.push(dir.join(format!("{name}-{file}")).display().to_string());
        }
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    for (ranks, extra) in [(2, &[][..]), (4, &["--replicas", "2"][..])] {
        let name = format!("np{ranks}");
        let summary = dir.join(format!("{name}.json"));
        let out = mpirun_np(ranks)
            .arg(env!("CARGO_BIN_EXE_mpi_example"))
            .arg(&summary)
            .args(flags(&name, &[extra, &["--transport", "mpi"]].concat()))
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{name}: {}\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        // Rank 0 alone prints.
        assert_eq!(
            stdout.matches("held-out loss").count(),
            1,
            "{name}: {stdout}"
        );
        assert_eq!(
            stdout.matches("wrote the Chrome trace").count(),
            1,
            "{name}"
        );
        let got: Value = serde_json::from_str(&std::fs::read_to_string(&summary).unwrap()).unwrap();
        let got_losses = floats(&got["losses"]);
        // The same flags in this process, on channels.
        let args = wgpipe_apps::train_transformer::TransformerArgs::parse_from_args(flags(
            &format!("{name}-local"),
            extra,
        ))
        .unwrap();
        let want = wgpipe_apps::train_transformer::run_with(
            args,
            &std::sync::atomic::AtomicBool::new(false),
        )
        .unwrap();
        // Same arithmetic, dropout keys, gradient clipping and replica averaging as in one
        // process (with --replicas 2 there too): bit-identical.
        assert_eq!(got_losses, want.losses, "{name}");
        // Evaluation and sampling run as forward-only rounds across the ranks (no rank
        // gathers the model): the same bits, and so the same text, as in one process.
        assert_eq!(
            got["eval_loss"].as_f64().unwrap() as f32,
            want.eval_loss,
            "{name}"
        );
        assert_eq!(got["sample"].as_str().unwrap(), want.sample, "{name}");
        let svg = std::fs::read_to_string(dir.join(format!("{name}-timeline.svg"))).unwrap();
        assert!(svg.trim_end().ends_with("</svg>"));
        if ranks == 4 {
            // 2 replicas x M = 2 with dropout draw the masks of one pipeline over M = 4: the
            // same training at float noise (the gradient sums differ in order).
            let mut alone = flags(&format!("{name}-alone"), &[]);
            alone.extend(["--micro-batches".to_string(), "4".to_string()]);
            let args =
                wgpipe_apps::train_transformer::TransformerArgs::parse_from_args(alone).unwrap();
            let one = wgpipe_apps::train_transformer::run_with(
                args,
                &std::sync::atomic::AtomicBool::new(false),
            )
            .unwrap();
            let err = rel_err(&got_losses, &one.losses);
            assert!(err <= 1e-5, "{name} vs M = 4 alone: {err:.2e}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Under MPI each rank of the transformer example builds only the layers of its own stage
/// (from the model's factory of layer ranges): the most its process ever held on the CPU device,
/// where layers are built before they go to their stage's device, is its own layers plus one
/// block (each layer is built alone once to be described) and a little for the data, far below
/// the whole model. Evaluation and sampling run across the 4 ranks without gathering: the same
/// held-out loss and text as one process.
#[test]
fn each_rank_of_the_transformer_example_builds_only_its_own_layers() {
    let dir = fresh_dir("local-build");
    let summary = dir.join("summary.json");
    let mut flags: Vec<String> = [
        "--quiet",
        "--device",
        "sim",
        "--stages",
        "4",
        "--micro-batches",
        "2",
        "--layers",
        "8",
        "--d-model",
        "64",
        "--heads",
        "2",
        "--seq-len",
        "16",
        "--batch",
        "8",
        "--sample-len",
        "6",
        "--steps",
        "2",
        "--schedule",
        "1f1b",
        "--balance",
        "3,3,3,2",
    ]
    .map(String::from)
    .to_vec();
    for (flag, file) in [("--trace", "trace.json"), ("--timeline", "timeline.svg")] {
        flags.push(flag.into());
        flags.push(dir.join(file).display().to_string());
    }
    let child = mpirun_np(4)
        .arg(env!("CARGO_BIN_EXE_mpi_example"))
        .arg(&summary)
        .args(&flags)
        .args(["--transport", "mpi"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let (ok, text, _) = output_within(child, Instant::now(), Duration::from_secs(120), "np4");
    assert!(ok, "{text}");
    let cfg = wgpipe_models::TransformerLm {
        vocab: 28,
        d_model: 64,
        heads: 2,
        layers: 8,
        seq_len: 16,
        dropout: 0.0,
        tie_embeddings: true,
    };
    let bytes = |range: std::ops::Range<usize>| -> usize {
        let layers = cfg
            .build_range(0, range, &wgpipe_tensor::Device::cpu())
            .unwrap();
        layers
            .iter()
            .flat_map(|l| l.parameters())
            .map(|(_, p)| 4 * p.value().numel())
            .sum()
    };
    let whole = 4 * cfg.parameter_count();
    let block = bytes(1..2);
    for (rank, range) in [0..3, 3..6, 6..9, 9..11].into_iter().enumerate() {
        let path = format!("{}.rank{rank}.json", summary.display());
        let v: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let peak = v["cpu_peak_bytes"].as_u64().unwrap() as usize;
        let own = bytes(range.clone());
        assert!(
            peak <= own + block + (16 << 10),
            "rank {rank} (layers {range:?}, {own} bytes) held {peak} bytes at most on the CPU; a \
             block is {block}, the whole model {whole}"
        );
        assert!(peak < whole / 2, "rank {rank}: {peak} of {whole}");
    }
    same_as_one_process(&summary, flags);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `mpirun` of one program whose two ranks get different arguments (`-np 1 ... : -np 1 ...`),
/// killed past `bound`: its exit status, output and how long it ran.
fn mpirun_two(
    program: &str,
    rank0: &[String],
    rank1: &[String],
    bound: Duration,
) -> (bool, String, f64) {
    let mut cmd = mpirun_np(1);
    cmd.arg(program)
        .args(rank0)
        .args([":", "-np", "1", program])
        .args(rank1)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let start = Instant::now();
    let child = cmd.spawn().unwrap();
    output_within(child, start, bound, &format!("{rank0:?} : {rank1:?}"))
}

/// Waits for `child` (started at `start`), killing it and failing the test past `bound`:
/// whether it succeeded, its stdout and stderr, and the seconds it ran.
fn output_within(
    mut child: std::process::Child,
    start: Instant,
    bound: Duration,
    what: &str,
) -> (bool, String, f64) {
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > bound {
            let _ = child.kill();
            panic!("{what}: the job still runs {bound:?} after start");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let secs = start.elapsed().as_secs_f64();
    let out = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text, secs)
}

/// Ranks started with different settings (the run's, like --steps, or the pipeline's, like
/// --precision or --micro-batches) refuse to start, naming the setting and each
/// rank's value, well within a bound (60 s; it takes a few seconds).
#[test]
fn ranks_started_with_different_settings_refuse_to_start_naming_them() {
    let dir = fresh_dir("settings");
    let flags = |rank: usize, flag: &str, value: &str| -> Vec<String> {
        let mut v = tiny_example_flags();
        v.extend(["--steps", "3", "--transport", "mpi"].map(|s| s.to_string()));
        // A later flag overrides an earlier one.
        v.extend([flag.to_string(), value.to_string()]);
        let mut args = vec![dir.join(format!("rank{rank}.json")).display().to_string()];
        args.extend(v);
        args
    };
    for (flag, name, a, b) in [
        ("--steps", "--steps", "3", "4"),
        ("--precision", "precision", "f32", "bf16"),
        ("--micro-batches", "micro-batches", "2", "4"),
        ("--seed", "seed", "0", "1"),
    ] {
        let (ok, text, secs) = mpirun_two(
            env!("CARGO_BIN_EXE_mpi_example"),
            &flags(0, flag, a),
            &flags(1, flag, b),
            Duration::from_secs(60),
        );
        assert!(!ok, "{flag}: the job succeeded: {text}");
        let want = format!("{name} (rank 0: {a}, rank 1: {b})");
        assert!(
            text.contains(&want) && text.contains("different settings"),
            "{flag}: the ranks should name {want}: {text}"
        );
        println!("{flag}: the job refused to start, in {secs:.1} s");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A rank that ends its run early (here after 2 steps of 3) tells the others, whose next step
/// fails at once naming it; nothing waits for it (the job ends within a second or two of it).
#[test]
fn a_rank_that_ends_early_fails_the_others_next_step_at_once_naming_it() {
    let dir = fresh_dir("early-end");
    let job = |steps: usize| -> Vec<String> {
        let mut v = MpiJob {
            steps,
            ..MpiJob::new(ScheduleKind::OneFOneB, 2)
        }
        .args();
        v.push(dir.display().to_string());
        v
    };
    let (ok, text, secs) = mpirun_two(
        env!("CARGO_BIN_EXE_mpi_worker"),
        &job(2),
        &job(3),
        Duration::from_secs(60),
    );
    assert!(ok, "{text}");
    let read = |r: usize| -> Value {
        serde_json::from_str(&std::fs::read_to_string(dir.join(format!("rank{r}.json"))).unwrap())
            .unwrap()
    };
    let (r0, r1) = (read(0), read(1));
    assert_eq!(floats(&r0["losses"]).len(), 2);
    assert_eq!(floats(&r1["losses"]).len(), 2);
    let errors = r1["errors"].as_array().unwrap();
    assert_eq!(errors.len(), 1, "{errors:?}");
    let e = &errors[0];
    let what = e["text"].as_str().unwrap();
    assert!(what.contains("rank 0 has ended"), "{what}");
    assert!(e["secs"].as_f64().unwrap() < 1.0, "{e}");
    println!("the job ended after {secs:.1} s; rank 1's third step: {what}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Killed during a sharded save: rank 1 stops in the middle of save 2 (rank 0 has written its
/// shard, or is writing it, and waits for rank 1's), and is killed. The job ends at once
/// naming rank 1, and the folder still holds save 1, which loads.
#[test]
fn a_rank_killed_during_a_sharded_save_ends_the_job_and_the_last_checkpoint_loads() {
    killed_after_a_checkpoint(MpiJob {
        fault: Some((1, 2, MpiFault::StopInSave)),
        ..MpiJob::new(ScheduleKind::OneFOneB, 2)
    });
}

/// Killed during a reduction: K=2 x R=2; rank 3 (device 1 of replica 1) stops in the forward
/// of step 2 and is killed a second later, while rank 1 (device 1 of replica 0) has finished
/// its backward and its gradient bucket waits for rank 3 in the collective.
#[test]
fn a_rank_killed_during_a_reduction_ends_the_job_and_the_last_checkpoint_loads() {
    killed_after_a_checkpoint(MpiJob {
        replicas: 2,
        fault: Some((3, 2, MpiFault::Stop)),
        ..MpiJob::new(ScheduleKind::OneFOneB, 2)
    });
}

/// Killed during an evaluation: every rank evaluates before step 2; rank 1 stops in the
/// forward of its micro-batch 1 there and is killed.
#[test]
fn a_rank_killed_during_an_evaluation_ends_the_job_and_the_last_checkpoint_loads() {
    killed_after_a_checkpoint(MpiJob {
        fault: Some((1, 2, MpiFault::StopInEvaluation)),
        ..MpiJob::new(ScheduleKind::OneFOneB, 2)
    });
}

/// Runs `job` (a stopping fault at step 2) with a sharded save after step 1, kills the rank
/// that stops (SIGKILL) once it has stood still a second (the other ranks are then waiting on
/// it), and checks that the job ends within a bound naming the rank, that no rank finished,
/// and that the checkpoint folder loads in one process as the checkpoint of step 1.
fn killed_after_a_checkpoint(job: MpiJob) {
    let (victim, _, fault) = job.fault.unwrap();
    let job = MpiJob {
        save_at: Some(1),
        sharded: true,
        steps: 3,
        ..job
    };
    let ranks = job.k * job.replicas;
    let tag = format!("killed-{fault:?}");
    let dir = fresh_dir(&tag);
    // The ranks must not give up on the stopped rank before it is killed.
    let mut child = spawn_job(&job, ranks, &dir, &[("WGPIPE_MPI_PEER_TIMEOUT", "60")]);
    let pid = stopped_rank(&mut child, &dir, victim, &tag);
    // Save 2 half done: rank 0 writes its shard while the victim stands still, which on a
    // loaded machine can take longer than the second below (the shard appears whole, by a
    // rename).
    let half = dir
        .join("ckpt")
        .join("model-save2-00001-of-00002.safetensors");
    if fault == MpiFault::StopInSave {
        let since = Instant::now();
        while !half.exists() && since.elapsed() < Duration::from_secs(60) {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    std::thread::sleep(Duration::from_secs(1));
    let killed = Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status();
    assert!(killed.is_ok_and(|s| s.success()), "{tag}: kill failed");
    let (ok, text, secs) = output_within(child, Instant::now(), Duration::from_secs(20), &tag);
    assert!(!ok, "{tag}: the job succeeded: {text}");
    assert!(
        text.contains(&format!("rank {victim}")) && text.contains("signal 9"),
        "{tag}: the message does not name the killed rank: {text}"
    );
    for r in 0..ranks {
        assert!(
            !dir.join(format!("rank{r}.json")).exists(),
            "{tag}: rank {r} finished the job"
        );
    }
    println!("{tag}: the job ended {secs:.1} s after the kill");
    if fault == MpiFault::StopInSave {
        // Save 2 was half done: rank 0 had written its shard, which the index never named.
        assert!(half.exists(), "{tag}: rank 0 wrote no shard of save 2");
    }
    // The last complete checkpoint: step 1's, as the uninterrupted run in one process has it.
    let (x, y) = MpiJob::data();
    let mut straight = dp_sim_pipeline(job.replicas, || MpiJob::model().0, &job.cfg()).unwrap();
    let (at1, _) = pipe_train(&mut straight, &x, &y, &mse, 1);
    let mut one = dp_sim_pipeline(job.replicas, || MpiJob::model().0, &job.cfg()).unwrap();
    let restored = one
        .load(dir.join("ckpt"), &wgpipe_pipeline::LoadOptions::default())
        .unwrap_or_else(|e| panic!("{tag}: the last checkpoint does not load: {e}"));
    assert_eq!(restored.step, 1, "{tag}");
    assert!(
        snapshot(&one.named_parameters()) == at1.params,
        "{tag}: the loaded parameters are not step 1's"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The pid of rank `rank` of the job `child` runs (into `dir`) once that rank has stopped
/// (its state in `/proc` is `T`); fails the test if the job ends first or nothing stops
/// within 60 s.
fn stopped_rank(child: &mut std::process::Child, dir: &Path, rank: usize, tag: &str) -> u32 {
    let start = Instant::now();
    loop {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "{tag}: rank {rank} did not stop within 60 s"
        );
        if let Some(status) = child.try_wait().unwrap() {
            panic!("{tag}: the job ended ({status}) before rank {rank} stopped");
        }
        let pid = std::fs::read_to_string(dir.join(format!("rank{rank}.pid")))
            .ok()
            .and_then(|p| p.trim().parse::<u32>().ok());
        if let Some(pid) = pid {
            // `/proc/<pid>/stat`: "pid (comm) state ...".
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let state = stat
                .rsplit_once(") ")
                .and_then(|(_, rest)| rest.chars().next());
            if state == Some('T') {
                return pid;
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A tied Llama from its Hugging Face folder fine-tuned over 2 ranks (`finetune_lm
/// --transport mpi`; each rank reads only its own stage's tensors, the tied table on both):
/// the held-out losses, every step's loss and the sampled continuation of a prompt (top-k at a
/// temperature) equal one process's, bit for bit, and the folder
/// each rank wrote its own shard of (`--save-hf`) holds one process's tensors, bit for bit.
#[test]
fn a_hugging_face_llama_fine_tuned_over_mpi_equals_one_process_and_saves_by_rank() {
    let dir = fresh_dir("mpi-finetune");
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures/llama_tied");
    let flags = |save: &Path| -> Vec<String> {
        let from = fixture.display().to_string();
        let trace = save.with_extension("trace.json").display().to_string();
        let timeline = save.with_extension("timeline.svg").display().to_string();
        let save = save.display().to_string();
        [
            "--from",
            &from,
            "--quiet",
            "--device",
            "cpu",
            "--stages",
            "2",
            "--micro-batches",
            "2",
            "--batch",
            "4",
            "--seq-len",
            "8",
            "--steps",
            "3",
            "--plan",
            "off",
            "--schedule",
            "1f1b",
            "--save-hf",
            &save,
            "--prompt",
            "ab",
            "--new-tokens",
            "5",
            "--temperature",
            "0.8",
            "--top-k",
            "10",
            "--trace",
            &trace,
            "--timeline",
            &timeline,
        ]
        .map(String::from)
        .to_vec()
    };
    let got = summary_over_mpi(
        env!("CARGO_BIN_EXE_mpi_finetune"),
        &dir,
        flags(&dir.join("by-rank")),
    );
    let args =
        wgpipe_apps::finetune_lm::FinetuneArgs::parse_from_args(flags(&dir.join("one"))).unwrap();
    let want = wgpipe_apps::finetune_lm::run(args).unwrap();
    assert_eq!(floats(&got["losses"]), want.losses);
    assert!(want.losses.len() == 3 && want.losses.iter().all(|l| l.is_finite()));
    assert_eq!(
        got["eval_before"].as_f64().unwrap() as f32,
        want.eval_before
    );
    assert_eq!(got["eval_after"].as_f64().unwrap() as f32, want.eval_after);
    let generated: Vec<u32> = got["generated"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    assert_eq!(generated, want.generated, "sampled ids");
    assert_eq!(generated.len(), 5);
    let tensors = |folder: &str| {
        let ck = wgpipe_models::hf::HfCheckpoint::open(&dir.join(folder)).unwrap();
        let (_, layers) =
            wgpipe_models::hf::load_llama(&dir.join(folder), 0..4, &wgpipe_tensor::Device::cpu())
                .unwrap();
        let bits: Vec<Vec<u32>> = wgpipe_models::sequence_parameters(&layers)
            .iter()
            .map(|(_, p)| {
                p.value()
                    .to_vec()
                    .unwrap()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect()
            })
            .collect();
        (ck.names(), bits)
    };
    let (by_rank, one) = (tensors("by-rank"), tensors("one"));
    assert_eq!(by_rank, one);
    assert!(
        !by_rank.0.contains(&"lm_head.weight".to_string()),
        "tied: the table once"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `train_cnn --from` a BiT checkpoint over `mpirun -np 2` (K=2, `--transport mpi`, each rank
/// reading only its own stages' tensors) on the committed image folder: the losses and the
/// held-out accuracy after each epoch equal one process's, bit for bit, and the timm folder each
/// rank wrote its shard of (`--save-hf`) holds one process's tensors, bit for bit.
#[test]
fn a_bit_checkpoint_fine_tuned_over_mpi_equals_one_process() {
    let dir = fresh_dir("mpi-bit");
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures");
    let flags = |save: &Path| -> Vec<String> {
        let from = fixtures.join("bit/model.safetensors").display().to_string();
        let images = fixtures.join("image_folder").display().to_string();
        let trace = save.with_extension("trace.json").display().to_string();
        let timeline = save.with_extension("timeline.svg").display().to_string();
        let save = save.display().to_string();
        [
            "--from",
            &from,
            "--images",
            &images,
            "--image-size",
            "32",
            "--quiet",
            "--device",
            "cpu",
            "--stages",
            "2",
            "--micro-batches",
            "2",
            "--batch",
            "4",
            "--steps",
            "4",
            "--plan",
            "off",
            "--freeze",
            "0",
            "--save-hf",
            &save,
            "--trace",
            &trace,
            "--timeline",
            &timeline,
        ]
        .map(String::from)
        .to_vec()
    };
    let got = summary_over_mpi(
        env!("CARGO_BIN_EXE_mpi_cnn"),
        &dir,
        flags(&dir.join("by-rank")),
    );
    let args = wgpipe_apps::train_cnn::CnnArgs::parse_from_args(flags(&dir.join("one"))).unwrap();
    let want =
        wgpipe_apps::train_cnn::run_with(args, &std::sync::atomic::AtomicBool::new(false)).unwrap();
    assert_eq!(floats(&got["losses"]), want.losses);
    assert!(want.losses.len() == 4 && want.losses.iter().all(|l| l.is_finite()));
    let accuracies: Vec<(u64, f64)> = got["epoch_accuracy"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p[0].as_u64().unwrap(), p[1].as_f64().unwrap()))
        .collect();
    assert_eq!(accuracies, want.epoch_accuracy);
    // 6 training images, batch 4: an epoch is one step.
    assert_eq!(accuracies.len(), 4);
    let tensors = |folder: &str| {
        let ck = wgpipe_models::hf::HfCheckpoint::open(&dir.join(folder)).unwrap();
        let bits: Vec<(String, Vec<u32>)> = ck
            .names()
            .into_iter()
            .map(|n| {
                let shape = ck.shape(&n).unwrap().to_vec();
                let v = ck
                    .read(&n, &shape, "the test", &wgpipe_tensor::Device::cpu())
                    .unwrap()
                    .to_vec()
                    .unwrap();
                (n, v.iter().map(|x| x.to_bits()).collect())
            })
            .collect();
        bits
    };
    let (by_rank, one) = (tensors("by-rank"), tensors("one"));
    assert_eq!(by_rank.len(), one.len());
    assert!(by_rank == one, "the folders differ");
    std::fs::remove_dir_all(&dir).unwrap();
}
