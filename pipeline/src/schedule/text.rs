//! Schedules as text: one line per device, actions separated by commas, written as torch's
//! pipelining writes them (`0F0`, `1I3`, `2SEND_F1`), after `#` header lines naming the schedule,
//! the micro-batch count and the placement. Rows with compute actions only get their transfers
//! inserted (as torch's `_load_csv` runtime does).
//!
//! ```text
//! # name: my-schedule
//! # micro_batches: 2
//! # placement: 0,1
//! 0F0,0F1,0B1,0B0
//! 1F0,1B0,1F1,1B1
//! ```

use std::fmt::Write as _;

use super::{Action, ActionKind, Schedule, ScheduleError};

fn parse_error(line: usize, msg: impl Into<String>) -> ScheduleError {
    ScheduleError::Parse {
        line,
        msg: msg.into(),
    }
}

/// Parses one action token such as `12SEND_B3`.
fn parse_action(token: &str, line: usize) -> Result<Action, ScheduleError> {
    let digits = |s: &str| s.chars().take_while(char::is_ascii_digit).count();
    let n = digits(token);
    let rest = &token[n..];
    let kind_len = rest.len() - rest.chars().rev().take_while(char::is_ascii_digit).count();
    let (kind, mb) = rest.split_at(kind_len);
    let kind = ActionKind::ALL
        .into_iter()
        .find(|k| k.token() == kind)
        .ok_or_else(|| {
            parse_error(
                line,
                format!(
                    "'{token}': unknown action '{kind}' (expected stage, one of F R B I W SEND_F \
                     RECV_F SEND_B RECV_B, micro-batch, e.g. 0F3)"
                ),
            )
        })?;
    let number = |s: &str, what: &str| {
        s.parse::<usize>()
            .map_err(|_| parse_error(line, format!("'{token}': missing or bad {what}")))
    };
    Ok(Action::new(
        kind,
        number(&token[..n], "stage")?,
        number(mb, "micro-batch")?,
    ))
}

impl Schedule {
    /// Reads a schedule written by [`Schedule::to_text`] or by hand (see the module docs).
    /// Without a `placement` header each device holds one stage (stage d on device d); without
    /// `micro_batches` the count is one more than the largest micro-batch named. The result is
    /// validated.
    pub fn parse(text: &str) -> Result<Schedule, ScheduleError> {
        let mut name = "custom".to_string();
        let mut micro_batches = None;
        let mut placement: Option<Vec<usize>> = None;
        let mut rows = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let line = i + 1;
            let content = raw.trim();
            if content.is_empty() {
                continue;
            }
            if let Some(header) = content.strip_prefix('#') {
                let Some((key, value)) = header.split_once(':') else {
                    continue; // a comment
                };
                let value = value.trim();
                match key.trim() {
                    "name" => name = value.to_string(),
                    "micro_batches" => {
                        micro_batches = Some(value.parse::<usize>().map_err(|_| {
                            parse_error(line, format!("micro_batches '{value}' is not a number"))
                        })?)
                    }
                    "placement" => {
                        placement = Some(
                            value
                                .split(',')
                                .map(|d| {
                                    d.trim().parse::<usize>().map_err(|_| {
                                        parse_error(
                                            line,
                                            format!("placement entry '{d}' is not a device number"),
                                        )
                                    })
                                })
                                .collect::<Result<_, _>>()?,
                        )
                    }
                    _ => {}
                }
                continue;
            }
            let actions = content
                .split(',')
                .map(str::trim)
                .filter(|t| !t.is_empty())
                .map(|t| parse_action(t, line))
                .collect::<Result<Vec<_>, _>>()?;
            rows.push(actions);
        }
        let placement = placement.unwrap_or_else(|| (0..rows.len()).collect());
        let m = micro_batches.unwrap_or_else(|| {
            rows.iter()
                .flatten()
                .map(|a| a.micro_batch + 1)
                .max()
                .unwrap_or(0)
        });
        let compute_only = rows.iter().flatten().all(|a| a.is_compute());
        let schedule = if compute_only {
            Schedule::from_compute(name, m, placement, rows)
        } else {
            Schedule {
                name,
                num_micro_batches: m,
                placement,
                devices: rows,
                in_flight_limit: None,
            }
        };
        schedule.validate()?;
        Ok(schedule)
    }

    /// The schedule as text that [`Schedule::parse`] reads back to an equal schedule (the
    /// in-flight limit is not written).
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "# name: {}", self.name);
        let _ = writeln!(out, "# micro_batches: {}", self.num_micro_batches);
        let placement: Vec<String> = self.placement.iter().map(usize::to_string).collect();
        let _ = writeln!(out, "# placement: {}", placement.join(","));
        for list in &self.devices {
            let actions: Vec<String> = list.iter().map(Action::to_string).collect();
            let _ = writeln!(out, "{}", actions.join(","));
        }
        out
    }
}
