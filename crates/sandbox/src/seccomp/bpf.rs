//! Airlock's seccomp filter compiler: one classic-BPF program that finds a system call
//! by binary search over the numbers that have rules, instead of comparing them one by
//! one.
//!
//! Why not seccompiler's compiler (which Airlock used before, and which the tests still
//! use as the reference): it emits a linear chain, so every system call the filter lets
//! through is compared with every listed number first. That costs little when the
//! filter runs (it is JIT-compiled), but the kernel builds a per-filter action cache
//! when a filter is attached by emulating the program once for every system call
//! number, with interrupts off: with a linear chain of some 55 numbers that was the
//! largest part of a sandbox's 237 µs seccomp step (docs/decisions.md, "Where a shell
//! call's time goes"). A binary search walks a dozen instructions or so per number.
//!
//! The program: the architecture check (any other architecture kills the process, as
//! seccompiler's does), the number loaded, numbers at or above `high_from` answered at
//! once (x32 system calls), the search — whose leaves answer a number without rules
//! themselves —, then one block per number with rules: its rules in turn, each a
//! conjunction of argument conditions, the first that holds returning the number's
//! action; none holding (or a number not listed) returns the default.

use std::collections::BTreeMap;

use seccompiler::sock_filter;

/// Instruction codes (linux/bpf_common.h).
const LD_W_ABS: u16 = 0x20; // BPF_LD | BPF_W | BPF_ABS
const AND_K: u16 = 0x54; // BPF_ALU | BPF_AND | BPF_K
const JA: u16 = 0x05; // BPF_JMP | BPF_JA
const JEQ_K: u16 = 0x15; // BPF_JMP | BPF_JEQ | BPF_K
const JGE_K: u16 = 0x35; // BPF_JMP | BPF_JGE | BPF_K
const RET_K: u16 = 0x06; // BPF_RET | BPF_K

/// Offsets in `struct seccomp_data`.
const NR_OFFSET: u32 = 0;
const ARCH_OFFSET: u32 = 4;
const ARGS_OFFSET: u32 = 16;

/// Numbers a search leaf compares one by one: fewer instructions than a deeper tree (a
/// leaf's numbers share their returns), at a few more steps of the kernel's emulation
/// for a number in the leaf; 8 was the quickest to attach of 2, 4 and 8 (measured:
/// docs/decisions.md, "A shorter seccomp program").
const LEAF: usize = 8;

/// One `thiserror` enum per module: what the compiler refuses.
#[derive(Debug, thiserror::Error)]
pub enum BpfError {
    #[error("argument index {0} is not one of a system call's six")]
    Argument(u8),
    #[error("a conditional jump of {0} instructions exceeds classic BPF's 255")]
    JumpTooFar(usize),
    #[error("the filter has {0} instructions, more than the kernel's 4096")]
    TooLong(usize),
}

/// How much of an argument a condition reads: its low 32 bits, or all 64.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Width {
    Dword,
    Qword,
}

/// A comparison of an argument with a constant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cmp {
    Eq(u64),
    Ne(u64),
    /// `arg & mask != value & mask`.
    MaskedNe {
        mask: u64,
        value: u64,
    },
    /// `arg & mask != 0`: any of the mask's bits set. One test where rules of one
    /// bit each would take one test per bit.
    AnyBit(u64),
}

/// One condition on one argument (0–5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Cond {
    pub arg: u8,
    pub width: Width,
    pub cmp: Cmp,
}

/// What one listed system call gets: `action` when any rule holds — each rule a list of
/// conditions that must all hold — and always when there is no rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Entry {
    pub rules: Vec<Vec<Cond>>,
    pub action: u32,
}

/// A whole filter.
#[derive(Debug, Clone)]
pub(crate) struct Filter {
    /// `AUDIT_ARCH_*` of the architecture the numbers are for.
    pub arch: u32,
    pub entries: BTreeMap<u32, Entry>,
    /// Numbers at or above the first value get the second, before any other rule.
    pub high_from: Option<(u32, u32)>,
    pub default: u32,
}

type Label = usize;

/// An instruction whose jumps name labels, resolved once the layout is known.
enum Op {
    Stmt(u16, u32),
    /// Conditional jump: to `jt` when the comparison holds, else to `jf`.
    Jump(u16, u32, Label, Label),
    Always(Label),
    Mark(Label),
}

#[derive(Default)]
struct Emitter {
    ops: Vec<Op>,
    labels: usize,
}

impl Emitter {
    fn label(&mut self) -> Label {
        self.labels += 1;
        self.labels - 1
    }

    fn mark(&mut self, label: Label) {
        self.ops.push(Op::Mark(label));
    }

    fn stmt(&mut self, code: u16, k: u32) {
        self.ops.push(Op::Stmt(code, k));
    }

    fn jump(&mut self, code: u16, k: u32, jt: Label, jf: Label) {
        self.ops.push(Op::Jump(code, k, jt, jf));
    }

    fn always(&mut self, to: Label) {
        self.ops.push(Op::Always(to));
    }

    fn finish(self) -> Result<Vec<sock_filter>, BpfError> {
        let mut at = vec![0usize; self.labels];
        let mut len = 0usize;
        for op in &self.ops {
            match op {
                Op::Mark(label) => at[*label] = len,
                _ => len += 1,
            }
        }
        if len > 4096 {
            return Err(BpfError::TooLong(len));
        }
        let mut out = Vec::with_capacity(len);
        for op in self.ops {
            let next = out.len() + 1;
            let offset = |label: Label| at[label].saturating_sub(next);
            let short = |label: Label| {
                u8::try_from(offset(label)).map_err(|_| BpfError::JumpTooFar(offset(label)))
            };
            let ins = match op {
                Op::Mark(_) => continue,
                Op::Stmt(code, k) => sock_filter {
                    code,
                    jt: 0,
                    jf: 0,
                    k,
                },
                Op::Jump(code, k, jt, jf) => sock_filter {
                    code,
                    jt: short(jt)?,
                    jf: short(jf)?,
                    k,
                },
                Op::Always(label) => sock_filter {
                    code: JA,
                    jt: 0,
                    jf: 0,
                    // Within 4096 instructions: fits.
                    k: u32::try_from(offset(label)).unwrap_or(u32::MAX),
                },
            };
            out.push(ins);
        }
        Ok(out)
    }
}

/// Compiles `filter` (see the module documentation for the program's layout).
pub(crate) fn compile(filter: &Filter) -> Result<Vec<sock_filter>, BpfError> {
    let mut e = Emitter::default();
    let kill = e.label();
    let arch_ok = e.label();
    e.stmt(LD_W_ABS, ARCH_OFFSET);
    e.jump(JEQ_K, filter.arch, arch_ok, kill);
    e.mark(kill);
    e.stmt(RET_K, libc::SECCOMP_RET_KILL_PROCESS);
    e.mark(arch_ok);
    e.stmt(LD_W_ABS, NR_OFFSET);
    if let Some((from, action)) = filter.high_from {
        let high = e.label();
        let low = e.label();
        e.jump(JGE_K, from, high, low);
        e.mark(high);
        e.stmt(RET_K, action);
        e.mark(low);
    }
    let numbers: Vec<u32> = filter.entries.keys().copied().collect();
    // A number without rules is answered in its leaf; one with rules has a block.
    let targets: Vec<Target> = filter
        .entries
        .values()
        .map(|entry| {
            if entry.rules.is_empty() {
                Target::Answer(entry.action)
            } else {
                Target::Block(e.label())
            }
        })
        .collect();
    search(&mut e, &numbers, &targets, filter.default);
    for ((_, entry), target) in filter.entries.iter().zip(&targets) {
        if let Target::Block(block) = target {
            e.mark(*block);
            rules(&mut e, entry, filter.default)?;
        }
    }
    e.finish()
}

/// Where a search leaf sends a number it finds.
enum Target {
    /// A number without rules: its action, returned in the leaf.
    Answer(u32),
    /// A number with rules: the block that tests them.
    Block(Label),
}

/// The search over `numbers` (sorted), the accumulator holding the number: a leaf
/// compares up to [`LEAF`] of them, above that it splits at the middle.
fn search(e: &mut Emitter, numbers: &[u32], targets: &[Target], default: u32) {
    if numbers.len() <= LEAF {
        leaf(e, numbers, targets, default);
        return;
    }
    let mid = numbers.len() / 2;
    let upper = e.label();
    let lower = e.label();
    e.jump(JGE_K, numbers[mid], upper, lower);
    e.mark(lower);
    search(e, &numbers[..mid], &targets[..mid], default);
    e.mark(upper);
    search(e, &numbers[mid..], &targets[mid..], default);
}

/// A leaf: its numbers compared in turn. A number without rules jumps to a return of
/// its action that the leaf's numbers with the same action share (most of the filter's
/// numbers are refused outright, so this is one instruction each instead of a jump to
/// a block of their own and that block's return); a number with rules jumps to its
/// block (`ja`, whose reach is not limited to 255); no number matching returns the
/// default. Every instruction the kernel converts and compiles when a sandbox attaches
/// the filter costs it time (docs/decisions.md, "A shorter seccomp program").
fn leaf(e: &mut Emitter, numbers: &[u32], targets: &[Target], default: u32) {
    let mut answers: Vec<(u32, Label)> = Vec::new();
    for (number, target) in numbers.iter().zip(targets) {
        let miss = e.label();
        match target {
            Target::Answer(action) => {
                let answer = match answers.iter().find(|(a, _)| a == action) {
                    Some((_, label)) => *label,
                    None => {
                        let label = e.label();
                        answers.push((*action, label));
                        label
                    }
                };
                e.jump(JEQ_K, *number, answer, miss);
            }
            Target::Block(block) => {
                let hit = e.label();
                e.jump(JEQ_K, *number, hit, miss);
                e.mark(hit);
                e.always(*block);
            }
        }
        e.mark(miss);
    }
    e.stmt(RET_K, default);
    for (action, label) in answers {
        e.mark(label);
        e.stmt(RET_K, action);
    }
}

/// One number's block: each rule in turn, the first that holds returning the action.
fn rules(e: &mut Emitter, entry: &Entry, default: u32) -> Result<(), BpfError> {
    if entry.rules.is_empty() {
        e.stmt(RET_K, entry.action);
        return Ok(());
    }
    for rule in &entry.rules {
        let next_rule = e.label();
        for cond in rule {
            condition(e, *cond, next_rule)?;
        }
        e.stmt(RET_K, entry.action);
        e.mark(next_rule);
    }
    e.stmt(RET_K, default);
    Ok(())
}

/// Falls through when `cond` holds, jumps to `fail` when it does not.
///
/// A condition compares 32-bit words of the argument — the low one, and for a 64-bit
/// condition the high one first — each as `word & mask == value`: `Eq` holds when
/// every word does, `Ne`, `MaskedNe` and `AnyBit` (which is `MaskedNe` with a
/// value of zero) when any word does not. A word whose mask is zero always matches and
/// is not loaded.
fn condition(e: &mut Emitter, cond: Cond, fail: Label) -> Result<(), BpfError> {
    if cond.arg > 5 {
        return Err(BpfError::Argument(cond.arg));
    }
    // Little-endian: the low half of an argument first.
    let low = ARGS_OFFSET + 8 * u32::from(cond.arg);
    let halves = |v: u64| {
        let [h0, h1, h2, h3, l0, l1, l2, l3] = v.to_be_bytes();
        (
            u32::from_be_bytes([h0, h1, h2, h3]),
            u32::from_be_bytes([l0, l1, l2, l3]),
        )
    };
    let (mask, value, negated) = match cond.cmp {
        Cmp::Eq(v) => (u64::MAX, v, false),
        Cmp::Ne(v) => (u64::MAX, v, true),
        Cmp::MaskedNe { mask, value } => (mask, value & mask, true),
        Cmp::AnyBit(mask) => (mask, 0, true),
    };
    let ((m_high, m_low), (v_high, v_low)) = (halves(mask), halves(value));
    let mut words = Vec::with_capacity(2);
    if cond.width == Width::Qword {
        words.push((low + 4, m_high, v_high));
    }
    words.push((low, m_low, v_low));
    words.retain(|(_, mask, _)| *mask != 0);

    let pass = e.label();
    let count = words.len();
    if negated && count == 0 {
        // No bit to differ in (`AnyBit(0)`): the condition never holds.
        e.always(fail);
        return Ok(());
    }
    for (i, (offset, mask, value)) in words.into_iter().enumerate() {
        let next = e.label();
        e.stmt(LD_W_ABS, offset);
        if mask != u32::MAX {
            e.stmt(AND_K, mask);
        }
        match (negated, i + 1 == count) {
            // Every word must match: a mismatch fails.
            (false, _) => e.jump(JEQ_K, value, next, fail),
            // Any word may differ: a difference passes, the last match fails.
            (true, false) => e.jump(JEQ_K, value, next, pass),
            (true, true) => e.jump(JEQ_K, value, fail, pass),
        }
        e.mark(next);
    }
    e.mark(pass);
    Ok(())
}
