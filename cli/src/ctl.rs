//! `iopath ctl PATH ...`: the client of a device process's control socket
//! (`iopath serve ... --control PATH`; the protocol is
//! `iopath_protocols::serve::control`'s). Each reply is printed as the JSON
//! line the device sent; a refused request prints its error on stderr and
//! makes the exit status 1.

use clap::{Args, Subcommand};
use iopath_devices::block::inject::{parse_rules, Rule};
use iopath_protocols::serve::control::ControlClient;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Args)]
pub struct CtlArgs {
    /// The control socket (`iopath serve ... --control PATH`).
    path: PathBuf,
    #[command(subcommand)]
    what: CtlCmd,
}

#[derive(Subcommand)]
enum CtlCmd {
    /// The injection rules, in the order they are tried.
    List,
    /// Commands seen, commands injected, and each rule's matches and firings.
    Stats,
    /// Adds rules, tried after those already there: one JSON object
    /// (`{"match":{"op":"read"},"action":{"status":{"sct":2,"sc":129}}}`) or
    /// the `inject=` text form (`op=read/status=2:0x81/every=10`, rules
    /// joined by `+`).
    Inject { rule: String },
    /// Removes the rule with this id.
    Remove { id: u64 },
    /// Removes every rule.
    Clear,
    /// Attaches NVMe namespace NSID (the host gets a Namespace Attribute
    /// Changed event where it enabled them, and rescans).
    Attach { nsid: u32 },
    /// Detaches NVMe namespace NSID (its data is kept for a later attach).
    Detach { nsid: u32 },
}

/// The requests `what` stands for (a text form with `+` is several).
fn requests(what: &CtlCmd) -> anyhow::Result<Vec<Value>> {
    Ok(match what {
        CtlCmd::List => vec![json!({"cmd": "list"})],
        CtlCmd::Stats => vec![json!({"cmd": "stats"})],
        CtlCmd::Clear => vec![json!({"cmd": "clear"})],
        CtlCmd::Remove { id } => vec![json!({"cmd": "remove", "id": id})],
        CtlCmd::Attach { nsid } => vec![json!({"cmd": "attach", "nsid": nsid})],
        CtlCmd::Detach { nsid } => vec![json!({"cmd": "detach", "nsid": nsid})],
        CtlCmd::Inject { rule } if rule.trim_start().starts_with('{') => {
            // Parsed here too: a bad rule is reported before it is sent.
            let r = Rule::from_json(rule.trim())?;
            vec![json!({"cmd": "inject", "rule": r.to_value()})]
        }
        CtlCmd::Inject { rule } => {
            parse_rules(rule)?.iter().map(|r| json!({"cmd": "inject", "rule": r.to_value()})).collect()
        }
    })
}

pub fn ctl(a: CtlArgs) -> anyhow::Result<i32> {
    let reqs = requests(&a.what)?;
    let mut c = ControlClient::connect(&a.path, Duration::from_secs(10))?;
    let mut code = 0;
    for r in &reqs {
        let back = c.ask(r)?;
        println!("{back}");
        if back["ok"] != true {
            eprintln!("iopath ctl: {}", back["error"].as_str().unwrap_or("refused"));
            code = 1;
        }
    }
    Ok(code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_rule_forms_become_the_same_requests() {
        let text = requests(&CtlCmd::Inject { rule: "op=read/lba=0-7/status=2:0x81/every=3".into() }).unwrap();
        let json =
            r#"{"match":{"op":"read","lba":[0,7]},"action":{"status":{"sct":2,"sc":129}},"trigger":{"every":3}}"#;
        let from_json = requests(&CtlCmd::Inject { rule: json.into() }).unwrap();
        assert_eq!(text, from_json);
        let two = requests(&CtlCmd::Inject { rule: "op=read/drop+op=write/fatal".into() }).unwrap();
        assert_eq!(two.len(), 2);
        assert!(requests(&CtlCmd::Inject { rule: "op=read/status=9:1".into() }).is_err());
        assert!(requests(&CtlCmd::Inject { rule: r#"{"action":"drop","x":1}"#.into() }).is_err());
    }
}
