//! [`Injector`]: a device's rule set as its threads and its control socket
//! share it (an `Arc`). The per-command cost while it holds no rule is one
//! relaxed load ([`Injector::armed`]); with rules, the set's lock. A
//! device that cannot carry out every action gives a check
//! ([`Injector::checked`]) that every rule added passes, at start or at run
//! time.

use super::rule::{Action, CommandView, Rule, RuleError};
use super::set::{RuleSet, Stats};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

/// A device's test of a rule it is given: Err([`RuleError::Refused`]) for
/// one it cannot carry out.
pub type Check = fn(&Rule) -> Result<(), RuleError>;

/// See the module doc.
pub struct Injector {
    /// True while the set holds a rule (written under the lock).
    armed: AtomicBool,
    set: Mutex<RuleSet>,
    check: Check,
}

impl Default for Injector {
    fn default() -> Self {
        Injector::checked(|_| Ok(()))
    }
}

impl Injector {
    /// An injector that takes every valid rule.
    pub fn new() -> Self {
        Self::default()
    }

    /// An injector that takes only the rules `check` passes.
    pub fn checked(check: Check) -> Self {
        Injector { armed: AtomicBool::new(false), set: Mutex::new(RuleSet::default()), check }
    }

    /// An injector holding `rules` (an `inject=` option), ids from 1.
    pub fn with_rules(rules: &[Rule]) -> Result<Self, RuleError> {
        let i = Injector::new();
        for r in rules {
            i.add(*r)?;
        }
        Ok(i)
    }

    /// Whether any rule is held: a front end asks [`decide`](Self::decide)
    /// only then. A rule added meanwhile applies from the next command on.
    #[inline]
    pub fn armed(&self) -> bool {
        self.armed.load(Ordering::Relaxed)
    }

    /// Adds a rule last (validated, and passed by the device's check); its id.
    pub fn add(&self, rule: Rule) -> Result<u64, RuleError> {
        (self.check)(&rule)?;
        let mut s = crate::lock(&self.set);
        let id = s.add(rule)?;
        self.armed.store(true, Ordering::Relaxed);
        Ok(id)
    }

    /// Removes rule `id`.
    pub fn remove(&self, id: u64) -> Result<Rule, RuleError> {
        let mut s = crate::lock(&self.set);
        let r = s.remove(id)?;
        self.armed.store(!s.is_empty(), Ordering::Relaxed);
        Ok(r)
    }

    /// The rules, in the order they are tried (with their ids).
    pub fn list(&self) -> Vec<Rule> {
        crate::lock(&self.set).list()
    }

    /// Removes every rule; how many there were.
    pub fn clear(&self) -> usize {
        let mut s = crate::lock(&self.set);
        self.armed.store(false, Ordering::Relaxed);
        s.clear()
    }

    pub fn stats(&self) -> Stats {
        crate::lock(&self.set).stats()
    }

    /// What to do with `cmd` ([`RuleSet::decide`]); None at once when no
    /// rule is held.
    pub fn decide(&self, cmd: &CommandView) -> Option<Action> {
        if !self.armed() {
            return None;
        }
        crate::lock(&self.set).decide(cmd)
    }
}

impl std::fmt::Debug for Injector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Injector").field("rules", &self.list()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::inject::{parse_rules, Kind};

    fn read(slba: u64) -> CommandView {
        CommandView {
            opcode: 2,
            kind: Kind::Read,
            nsid: 1,
            lba: Some(crate::block::inject::Lbas { slba, nlb: 0 }),
            qid: 1,
        }
    }

    #[test]
    fn a_check_refuses_a_rule_at_start_and_at_run_time() {
        let no_drop: Check = |r| match r.action {
            Action::Drop => Err(RuleError::Refused(format!("rule {r}: no drops here"))),
            _ => Ok(()),
        };
        let rules = parse_rules("op=read/drop+op=write/fatal").unwrap();
        let i = Injector::checked(no_drop);
        let e = i.add(rules[0]).unwrap_err();
        assert_eq!((e.field(), e.to_string().contains("no drops here")), (Some("action"), true));
        assert!(!i.armed() && i.list().is_empty(), "a refused rule is not held");
        assert!(i.add(rules[1]).is_ok());
        assert_eq!(i.list().len(), 1);
    }

    #[test]
    fn armed_follows_the_rules_held() {
        let i = Injector::new();
        assert!(!i.armed());
        assert_eq!(i.decide(&read(0)), None);
        assert_eq!(i.stats().commands, 0, "an unarmed injector does not count");
        let rules = parse_rules("op=read/lba=8-15/drop+op=write/fatal").unwrap();
        let a = i.add(rules[0]).unwrap();
        let b = i.add(rules[1]).unwrap();
        assert!(i.armed());
        assert_eq!(i.decide(&read(0)), None);
        assert_eq!(i.decide(&read(9)), Some(Action::Drop));
        i.remove(a).unwrap();
        assert!(i.armed(), "one rule left");
        assert_eq!(i.decide(&read(9)), None);
        assert_eq!(i.list().iter().map(|r| r.id).collect::<Vec<_>>(), [b]);
        assert_eq!(i.clear(), 1);
        assert!(!i.armed());
        assert_eq!(i.remove(b), Err(RuleError::NoSuchRule { id: b }));
        let s = i.stats();
        assert_eq!((s.commands, s.injected), (3, 1));
    }

    #[test]
    fn with_rules_takes_an_option_s_list_and_refuses_a_bad_one() {
        let rules = parse_rules("op=read/status=2:0x81:dnr/once").unwrap();
        let i = Injector::with_rules(&rules).unwrap();
        assert_eq!(i.list()[0].id, 1);
        let mut bad = rules[0];
        bad.action = Action::Delay { ns: u64::MAX };
        assert!(Injector::with_rules(&[bad]).is_err());
    }
}
