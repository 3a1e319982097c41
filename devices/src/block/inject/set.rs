//! A set of rules ([`RuleSet`]) and the one decision the device asks of
//! it per command ([`RuleSet::decide`]), with per-rule hit counters
//! ([`Stats`]). Pure: no threads, no clock, no I/O; the same rules, seeds
//! and commands give the same decisions. Callers hold it behind a lock.

use super::rule::*;

/// The most rules one set holds (a control socket peer adds them).
pub const MAX_RULES: usize = 64;

struct Entry {
    rule: Rule,
    matched: u64,
    fired: u64,
    /// A probability trigger's generator state (its seed at first).
    rng: u64,
}

impl Entry {
    /// Counts a match and tells whether the trigger fires on it.
    fn fires(&mut self) -> bool {
        self.matched += 1;
        match self.rule.trigger {
            Trigger::Always => true,
            Trigger::Once => self.matched == 1,
            Trigger::Every(n) => self.matched.is_multiple_of(n),
            Trigger::Count(n) => self.matched <= n,
            Trigger::Probability { ppb, .. } => splitmix64(&mut self.rng) % u64::from(PPB) < u64::from(ppb),
        }
    }
}

/// One rule's counters: commands that reached it and matched, and those
/// it fired on (its action was returned).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct RuleStats {
    pub id: u64,
    pub matched: u64,
    pub fired: u64,
}

/// The set's counters: commands decided since it was made, those given an
/// action, and each rule's own.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Stats {
    pub commands: u64,
    pub injected: u64,
    pub rules: Vec<RuleStats>,
}

/// Rules in the order they were added, ids from 1 up, never reused (a
/// stale `remove` cannot take a newer rule).
pub struct RuleSet {
    entries: Vec<Entry>,
    next_id: u64,
    commands: u64,
    injected: u64,
}

impl Default for RuleSet {
    fn default() -> Self {
        RuleSet { entries: Vec::new(), next_id: 1, commands: 0, injected: 0 }
    }
}

impl RuleSet {
    pub fn new() -> Self {
        Self::default()
    }

    /// Validates `rule` and adds it last, with a new id (its own `id` is
    /// replaced); returns the id.
    pub fn add(&mut self, mut rule: Rule) -> Result<u64, RuleError> {
        rule.validate()?;
        if self.entries.len() >= MAX_RULES {
            return Err(RuleError::TooManyRules { max: MAX_RULES });
        }
        rule.id = self.next_id;
        self.next_id += 1;
        let rng = match rule.trigger {
            Trigger::Probability { seed, .. } => seed,
            _ => 0,
        };
        self.entries.push(Entry { rule, matched: 0, fired: 0, rng });
        Ok(rule.id)
    }

    /// Removes rule `id` and gives it back.
    pub fn remove(&mut self, id: u64) -> Result<Rule, RuleError> {
        let at = self.entries.iter().position(|e| e.rule.id == id).ok_or(RuleError::NoSuchRule { id })?;
        Ok(self.entries.remove(at).rule)
    }

    /// Removes every rule (with its counters); returns how many. The set's
    /// own counters and the next id go on.
    pub fn clear(&mut self) -> usize {
        let n = self.entries.len();
        self.entries.clear();
        n
    }

    /// The rules, in the order they are tried.
    pub fn list(&self) -> Vec<Rule> {
        self.entries.iter().map(|e| e.rule).collect()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn stats(&self) -> Stats {
        let rules = self.entries.iter().map(|e| RuleStats { id: e.rule.id, matched: e.matched, fired: e.fired });
        Stats { commands: self.commands, injected: self.injected, rules: rules.collect() }
    }

    /// What to do with `cmd`: rules are tried in order; each that matches
    /// counts the match and asks its trigger; the first whose trigger
    /// fires wins, and the rules after it do not see the command (their
    /// counters and triggers stay as they were). None: execute it as usual.
    pub fn decide(&mut self, cmd: &CommandView) -> Option<Action> {
        self.commands += 1;
        for e in &mut self.entries {
            if e.rule.matcher.matches(cmd) && e.fires() {
                e.fired += 1;
                self.injected += 1;
                return Some(e.rule.action);
            }
        }
        None
    }
}
