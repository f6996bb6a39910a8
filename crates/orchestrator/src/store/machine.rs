//! The call/approval state machine and the audit seal, written once for both engines.
//!
//! Each engine implements [`Tx`]: primitive row operations inside one of its
//! transactions, or on a plain connection where the engine runs one statement on its
//! own. The SQL text and the locking (`BEGIN IMMEDIATE` in SQLite; `FOR UPDATE`,
//! `SKIP LOCKED` and the isolation level in PostgreSQL) stay with the engine. The rules
//! live here only: which state may move to which ([`CallMove`], [`ApprovalMove`],
//! [`Sweep`]), which error is returned when, and what is read back afterwards.
//!
//! The engine starts the transaction, awaits one function of this module and commits
//! when it returns `Ok` (rolls back on `Err`). [`decide_approval`] returns a [`Kept`]
//! answer: its writes are committed even when the answer is an error (an approval
//! decided too late is marked expired, then [`StoreError::Expired`] is returned).
//!
//! The SQLite engine's primitives are synchronous and it drives these futures with
//! `futures::executor::block_on` on the blocking pool: nothing in them waits, so each
//! completes on its first poll.

use super::{
    Approval, ApprovalId, ApprovalStatus, AuditRecord, CallChange, CallId, CallOutcome, CallState,
    CallWrite, ExpiredApproval, NewApproval, NewAuditEvent, NewCall, PinCheck, PinnedDefinition,
    StoreError, StoredCall, Timestamp, ToolPin, now_millis, rfc3339, to_u64,
};
use crate::audit::{AuditKind, chain_hash};

/// Which states a statement on `calls` applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum States {
    /// Whatever state the call is in.
    Any,
    /// One of these.
    In(&'static [CallState]),
    /// Any but this one.
    Not(CallState),
}

/// The rows of `calls` a move (or a listing) applies to: those in [`CallFilter::states`]
/// or holding a lapsed claim, and of those only the ones a claimant holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct CallFilter<'a> {
    pub states: States,
    /// Also a `dispatched` call whose lease ended at or before this time (or that has
    /// none): a claim nobody holds any longer.
    pub or_lapsed_at: Option<Timestamp>,
    /// Only a call whose `claimed_by` is this.
    pub held_by: Option<&'a str>,
}

impl CallFilter<'static> {
    /// Calls in exactly these states.
    pub(super) const fn states(states: States) -> Self {
        Self {
            states,
            or_lapsed_at: None,
            held_by: None,
        }
    }

    /// Calls to dispatch at `now`: approved and never claimed, or dispatched and left
    /// by a claimant whose lease ran out.
    pub(super) const fn claimable(now: Timestamp) -> Self {
        Self {
            states: States::In(&[CallState::Approved]),
            or_lapsed_at: Some(now),
            held_by: None,
        }
    }
}

/// The columns a move writes besides `state`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum CallSet<'a> {
    /// Only the state.
    State,
    /// `approval_id`: the approval the call waits for.
    Approval(&'a ApprovalId),
    /// `claimed_by` and `lease_until`: who dispatches it, and until when the claim holds.
    Claim {
        claimant: &'a str,
        lease_until: Timestamp,
    },
    /// `lease_until`: a longer lease for the claim.
    Lease(Timestamp),
    /// `status`, `result`, `duration_ms`, `replica`, `finished_at`: the final outcome.
    Outcome(&'a CallOutcome),
}

/// One conditional update of one call: `UPDATE calls SET state = to, <set> WHERE
/// call_id = … AND <from>`. A single statement, so PostgreSQL re-checks `from` after a
/// concurrent writer commits and at most one of racing movers changes the row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct CallMove<'a> {
    pub call_id: &'a CallId,
    pub from: CallFilter<'a>,
    pub to: CallState,
    pub set: CallSet<'a>,
}

/// Who decided an approval, and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Verdict<'a> {
    pub by: &'a str,
    pub reason: Option<&'a str>,
}

/// One conditional update of one approval: `status` from `from` to `to`, stamped
/// `decided_at`, with `decided_by` and `reason` when a person decided (an expiry
/// leaves them as they are).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ApprovalMove<'a> {
    pub approval_id: &'a ApprovalId,
    pub from: ApprovalStatus,
    pub to: ApprovalStatus,
    pub decided_at: Timestamp,
    pub verdict: Option<Verdict<'a>>,
}

/// A batch move of approvals past their deadline: at most `limit` of those in `from`
/// with `expires_at <= due_by`, the earliest deadlines first (ties by id), move to
/// `to`, stamped `decided_at`. Concurrent sweepers take disjoint batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Sweep {
    pub from: ApprovalStatus,
    pub to: ApprovalStatus,
    pub due_by: Timestamp,
    pub decided_at: Timestamp,
    pub limit: usize,
}

/// The approval columns a decision is made on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct ApprovalState {
    pub call_id: CallId,
    pub status: ApprovalStatus,
    pub expires_at: Timestamp,
}

/// Whose call it is (what the expiry sweep reports, without the call's input).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct CallOwner {
    pub principal: String,
    pub session_id: Option<String>,
}

/// The audit chain's head anchor: the last record's `seq` and `hash`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct ChainHead {
    pub seq: i64,
    pub hash: String,
}

/// An answer whose transaction is committed whatever it is, an error included.
pub(super) type Kept<T> = Result<T, StoreError>;

/// Row operations of one engine inside one unit of work (a transaction, or a plain
/// connection where the engine runs single statements on their own). Rows come back
/// decoded by column name, statuses and states by `parse` (unknown text is
/// [`StoreError::Corrupt`]). Nothing here decides anything: the functions of this module
/// do.
pub(super) trait Tx {
    /// The head anchor, locked until the end of the transaction where the engine locks
    /// rows (PostgreSQL: `FOR UPDATE`); `None` if the row is gone.
    async fn chain_head(&mut self) -> Result<Option<ChainHead>, StoreError>;

    /// Inserts a sealed record.
    async fn insert_audit(&mut self, record: &AuditRecord) -> Result<(), StoreError>;

    /// Moves the head anchor to `seq` and `hash`.
    async fn move_chain_head(&mut self, seq: u64, hash: &str) -> Result<(), StoreError>;

    /// Inserts a call row: in state `call.state`, or with `outcome` already `finished`
    /// (the row an insert and then [`finish_call`] would leave, in one statement).
    /// `Ok(false)` if the id is taken; the unit of work can then only be rolled back
    /// (PostgreSQL aborts the transaction).
    async fn insert_call_row(
        &mut self,
        call: &NewCall,
        approval_id: Option<&ApprovalId>,
        outcome: Option<&CallOutcome>,
    ) -> Result<bool, StoreError>;

    async fn call_exists(&mut self, call_id: &CallId) -> Result<bool, StoreError>;

    async fn call(&mut self, call_id: &CallId) -> Result<Option<StoredCall>, StoreError>;

    async fn call_owner(&mut self, call_id: &CallId) -> Result<Option<CallOwner>, StoreError>;

    /// Applies a move; true if the call was in a `from` state (and so moved).
    async fn move_call(&mut self, mv: &CallMove<'_>) -> Result<bool, StoreError>;

    /// The ids of the calls `filter` applies to, oldest first (`created_at`, then id).
    async fn call_ids(&mut self, filter: &CallFilter<'_>) -> Result<Vec<CallId>, StoreError>;

    /// Inserts an approval row with `status`. `Ok(false)` if the id is taken (see
    /// [`Tx::insert_call_row`]).
    async fn insert_approval_row(
        &mut self,
        approval: &NewApproval,
        status: ApprovalStatus,
    ) -> Result<bool, StoreError>;

    /// What a decision needs of an approval, locked until the end of the transaction
    /// where the engine locks rows (PostgreSQL: `FOR UPDATE`).
    async fn approval_for_update(
        &mut self,
        approval_id: &ApprovalId,
    ) -> Result<Option<ApprovalState>, StoreError>;

    /// An approval with its call's fields, as listed.
    async fn approval(&mut self, approval_id: &ApprovalId) -> Result<Option<Approval>, StoreError>;

    /// Applies a move; true if the approval was in `from` (and so moved).
    async fn move_approval(&mut self, mv: &ApprovalMove<'_>) -> Result<bool, StoreError>;

    /// Who approved an approval so far, in the order they did.
    async fn approval_votes(&mut self, approval_id: &ApprovalId)
    -> Result<Vec<String>, StoreError>;

    /// Records one approver's approval (the caller checked it is not there yet).
    async fn insert_approval_vote(
        &mut self,
        approval_id: &ApprovalId,
        approver: &str,
        input_sha256: &str,
        at: Timestamp,
    ) -> Result<(), StoreError>;

    /// Drops the results of calls finished before `before`; how many it dropped.
    async fn prune_results(&mut self, before: Timestamp) -> Result<u64, StoreError>;

    /// Applies a sweep and returns the approvals it moved, each with its call.
    async fn sweep_approvals(
        &mut self,
        sweep: &Sweep,
    ) -> Result<Vec<(ApprovalId, CallId)>, StoreError>;

    /// A tool's pin. Callers lock the head anchor first, which serializes every writer
    /// of pins.
    async fn tool_pin(&mut self, tool: &str) -> Result<Option<ToolPin>, StoreError>;

    /// Inserts or replaces a tool's pin.
    async fn put_tool_pin(&mut self, pin: &ToolPin) -> Result<(), StoreError>;
}

fn head_missing() -> StoreError {
    StoreError::Corrupt(
        "the audit head anchor is missing (the log was tampered with); run `airlock audit verify`"
            .to_owned(),
    )
}

fn approval_not_found(id: &ApprovalId) -> StoreError {
    StoreError::NotFound {
        what: "approval",
        id: id.to_string(),
    }
}

fn call_not_found(id: &CallId) -> StoreError {
    StoreError::NotFound {
        what: "call",
        id: id.to_string(),
    }
}

/// Seals `event` onto the chain: the next `seq`, the time (now, read under the head's
/// lock so times follow `seq`), `prev_hash` and `hash`; inserts it and moves the head.
pub(super) async fn append(
    tx: &mut impl Tx,
    event: NewAuditEvent,
) -> Result<AuditRecord, StoreError> {
    let mut chain = Chain::default();
    let record = chain.append(tx, event).await?;
    chain.close(tx).await?;
    Ok(record)
}

/// The chain as one transaction appends to it: the head is read (and locked, where the
/// engine locks rows) at the first append, kept here between appends, and moved once,
/// by [`Chain::close`]. A call's write appends up to three events; reading and moving
/// the head once for all of them, instead of once per event, saves two statements per
/// event after the first. Nothing else may touch the head between the first append and
/// `close`.
#[derive(Default)]
struct Chain {
    /// The last record's `seq` and `hash` once something was appended.
    last: Option<(u64, String)>,
}

impl Chain {
    /// Seals `event` onto the chain (see [`append`]) and inserts it; the head moves at
    /// [`Chain::close`].
    async fn append(
        &mut self,
        tx: &mut impl Tx,
        event: NewAuditEvent,
    ) -> Result<AuditRecord, StoreError> {
        let (last_seq, last_hash) = match self.last.take() {
            Some(last) => last,
            None => {
                let head = tx.chain_head().await?.ok_or_else(head_missing)?;
                (to_u64(head.seq, "the audit head's seq")?, head.hash)
            }
        };
        let seq = last_seq + 1;
        let ts = rfc3339(now_millis());
        let hash = chain_hash(
            &last_hash,
            seq,
            &ts,
            event.kind.as_str(),
            event.call_id.as_deref(),
            event.principal.as_deref(),
            event.session_id.as_deref(),
            &event.data,
        );
        let record = AuditRecord {
            seq,
            ts,
            kind: event.kind.as_str().to_owned(),
            call_id: event.call_id,
            principal: event.principal,
            session_id: event.session_id,
            data: event.data,
            prev_hash: last_hash,
            hash,
        };
        tx.insert_audit(&record).await?;
        self.last = Some((seq, record.hash.clone()));
        Ok(record)
    }

    /// Moves the head to the last record appended, if any.
    async fn close(self, tx: &mut impl Tx) -> Result<(), StoreError> {
        match self.last {
            Some((seq, hash)) => tx.move_chain_head(seq, &hash).await,
            None => Ok(()),
        }
    }
}

/// See [`super::Store::check_tool_pin`]. The head anchor is locked first, so pin
/// checks and accepts of every replica are serialized with each other and the chain.
pub(super) async fn check_tool_pin(
    tx: &mut impl Tx,
    tool: &str,
    seen: PinnedDefinition,
) -> Result<PinCheck, StoreError> {
    tx.chain_head().await?.ok_or_else(head_missing)?;
    let now = now_millis();
    let Some(mut pin) = tx.tool_pin(tool).await? else {
        let event = NewAuditEvent::new(
            AuditKind::ToolPinned,
            serde_json::json!({"tool": tool, "group": seen.group, "digest": seen.digest}),
        );
        tx.put_tool_pin(&ToolPin {
            tool: tool.to_owned(),
            pinned: seen,
            pinned_at: now,
            accepted_by: None,
            pending: None,
            pending_since: None,
        })
        .await?;
        append(tx, event).await?;
        return Ok(PinCheck::FirstSeen);
    };
    if pin.pinned.digest == seen.digest {
        // Back to the pinned definition: a change it had shown is no longer served, so
        // there is nothing left to accept.
        if pin.pending.take().is_some() {
            pin.pending_since = None;
            tx.put_tool_pin(&pin).await?;
        }
        return Ok(PinCheck::Pinned);
    }
    if pin
        .pending
        .as_ref()
        .is_some_and(|pending| pending.digest == seen.digest)
    {
        return Ok(PinCheck::Changed);
    }
    let event = NewAuditEvent::new(
        AuditKind::ToolDefinitionChanged,
        serde_json::json!({
            "tool": tool,
            "group": seen.group,
            "pinned_digest": pin.pinned.digest,
            "seen_digest": seen.digest,
            "changed": changed_fields(&pin.pinned.definition, &seen.definition),
        }),
    );
    pin.pending = Some(seen);
    pin.pending_since = Some(now);
    tx.put_tool_pin(&pin).await?;
    append(tx, event).await?;
    Ok(PinCheck::Changed)
}

/// See [`super::Store::accept_tool_pin`].
pub(super) async fn accept_tool_pin(
    tx: &mut impl Tx,
    tool: &str,
    accepted_by: &str,
    reviewed: Option<&str>,
) -> Result<ToolPin, StoreError> {
    tx.chain_head().await?.ok_or_else(head_missing)?;
    let mut pin = tx
        .tool_pin(tool)
        .await?
        .ok_or_else(|| StoreError::NotFound {
            what: "pinned tool",
            id: tool.to_owned(),
        })?;
    let pending = pin
        .pending
        .take()
        .ok_or_else(|| StoreError::NothingToAccept {
            tool: tool.to_owned(),
        })?;
    if let Some(reviewed) = reviewed
        && !reviewed.eq_ignore_ascii_case(&pending.digest)
    {
        return Err(StoreError::PendingChanged {
            tool: tool.to_owned(),
            expected: reviewed.to_owned(),
            pending: pending.digest,
        });
    }
    let event = NewAuditEvent::new(
        AuditKind::ToolAccepted,
        serde_json::json!({
            "tool": tool,
            "group": pending.group,
            "previous_digest": pin.pinned.digest,
            "digest": pending.digest,
        }),
    )
    .principal(accepted_by);
    pin.pinned = pending;
    pin.pinned_at = now_millis();
    pin.accepted_by = Some(accepted_by.to_owned());
    pin.pending_since = None;
    tx.put_tool_pin(&pin).await?;
    append(tx, event).await?;
    Ok(pin)
}

/// The top-level fields of two definitions that differ (`description`,
/// `input_schema`, ...): what an auditor looks at first.
fn changed_fields(pinned: &serde_json::Value, seen: &serde_json::Value) -> Vec<String> {
    let empty = serde_json::Map::new();
    let pinned = pinned.as_object().unwrap_or(&empty);
    let seen = seen.as_object().unwrap_or(&empty);
    let mut keys: Vec<&String> = pinned.keys().chain(seen.keys()).collect();
    keys.sort();
    keys.dedup();
    keys.into_iter()
        .filter(|key| pinned.get(*key) != seen.get(*key))
        .cloned()
        .collect()
}

/// One call's write (see [`CallWrite`]): its gathered events, the change to its row,
/// then the events that hold only when the change took effect. Whether it did.
pub(super) async fn write_call(tx: &mut impl Tx, write: CallWrite) -> Result<bool, StoreError> {
    // The change below touches no audit record, so one head serves all the events.
    let mut chain = Chain::default();
    for event in write.events {
        chain.append(tx, event).await?;
    }
    let applied = match &write.change {
        CallChange::Nothing => true,
        CallChange::InsertClaimed {
            call,
            claimant,
            lease_until,
        } => {
            let approved = NewCall {
                state: CallState::Approved,
                ..call.clone()
            };
            insert_call(tx, &approved, None).await?;
            // Inserted just now in this transaction, so the claim cannot be lost; a
            // refusal here would be a broken rule, not a race.
            if !claim_for_dispatch(tx, &call.call_id, claimant, call.created_at, *lease_until)
                .await?
            {
                return Err(StoreError::Corrupt(format!(
                    "call {} could not be claimed by the transaction that inserted it",
                    call.call_id
                )));
            }
            true
        }
        // The finished row at once: an insert as `approved` and then the move to
        // `finished` wrote the row twice and its state's index entry twice, per call.
        CallChange::InsertFinished { call, outcome } => {
            if !tx.insert_call_row(call, None, Some(outcome)).await? {
                return Err(StoreError::AlreadyExists {
                    what: "call",
                    id: call.call_id.to_string(),
                });
            }
            true
        }
        CallChange::Finish { call_id, outcome } => finish_call(tx, call_id, outcome).await?,
        CallChange::Claim {
            call_id,
            claimant,
            now,
            lease_until,
        } => claim_for_dispatch(tx, call_id, claimant, *now, *lease_until).await?,
        CallChange::CreateApproval(approval) => {
            create_approval(tx, approval).await?;
            true
        }
    };
    if applied {
        for event in write.then {
            chain.append(tx, event).await?;
        }
    }
    chain.close(tx).await?;
    Ok(applied)
}

/// Records a call in the state it names; [`StoreError::AlreadyExists`] if the id is
/// taken.
pub(super) async fn insert_call(
    tx: &mut impl Tx,
    call: &NewCall,
    approval_id: Option<&ApprovalId>,
) -> Result<(), StoreError> {
    if tx.insert_call_row(call, approval_id, None).await? {
        Ok(())
    } else {
        Err(StoreError::AlreadyExists {
            what: "call",
            id: call.call_id.to_string(),
        })
    }
}

/// Any state but `finished` → `finished`, with the outcome. False if it was already
/// finished (the first outcome stays); [`StoreError::NotFound`] if there is no such call.
pub(super) async fn finish_call(
    tx: &mut impl Tx,
    call_id: &CallId,
    outcome: &CallOutcome,
) -> Result<bool, StoreError> {
    let finished = tx
        .move_call(&CallMove {
            call_id,
            from: CallFilter::states(States::Not(CallState::Finished)),
            to: CallState::Finished,
            set: CallSet::Outcome(outcome),
        })
        .await?;
    if !finished && !tx.call_exists(call_id).await? {
        return Err(call_not_found(call_id));
    }
    Ok(finished)
}

/// Drops the stored results of calls finished before `before` (`[store]
/// retention_days`); the calls, their statuses and the audit chain stay.
pub(super) async fn prune_results(tx: &mut impl Tx, before: Timestamp) -> Result<u64, StoreError> {
    tx.prune_results(before).await
}

/// A pending approval, and its call moved (from whatever state) or inserted as
/// `pending_approval`; the approval as listed. [`StoreError::AlreadyExists`] if either
/// id is taken by a new row.
pub(super) async fn create_approval(
    tx: &mut impl Tx,
    approval: &NewApproval,
) -> Result<Approval, StoreError> {
    let id = &approval.approval_id;
    let call = &approval.call;
    let parked = tx
        .move_call(&CallMove {
            call_id: &call.call_id,
            from: CallFilter::states(States::Any),
            to: CallState::PendingApproval,
            set: CallSet::Approval(id),
        })
        .await?;
    if !parked {
        let pending = NewCall {
            state: CallState::PendingApproval,
            ..call.clone()
        };
        insert_call(tx, &pending, Some(id)).await?;
    }
    if !tx
        .insert_approval_row(approval, ApprovalStatus::Pending)
        .await?
    {
        return Err(StoreError::AlreadyExists {
            what: "approval",
            id: id.to_string(),
        });
    }
    tx.approval(id).await?.ok_or_else(|| approval_not_found(id))
}

/// `pending` → `approved` (call `pending_approval` → `approved`) or `denied` (call →
/// `rejected`), then the approval read back. Refused with [`StoreError::NotFound`], or
/// [`StoreError::AlreadyDecided`] when it is no longer pending (both roll back). Past
/// its deadline (`expires_at <= now`) it moves to `expired` and its call to `rejected`
/// instead, and the kept answer is [`StoreError::Expired`].
pub(super) async fn decide_approval(
    tx: &mut impl Tx,
    approval_id: &ApprovalId,
    approve: bool,
    verdict: Verdict<'_>,
    now: Timestamp,
) -> Result<Kept<Approval>, StoreError> {
    let Some(found) = tx.approval_for_update(approval_id).await? else {
        return Err(approval_not_found(approval_id));
    };
    if found.status != ApprovalStatus::Pending {
        return Err(StoreError::AlreadyDecided {
            id: approval_id.to_string(),
            status: found.status,
        });
    }
    let waiting = CallFilter::states(States::In(&[CallState::PendingApproval]));
    if found.expires_at <= now {
        tx.move_approval(&ApprovalMove {
            approval_id,
            from: ApprovalStatus::Pending,
            to: ApprovalStatus::Expired,
            decided_at: now,
            verdict: None,
        })
        .await?;
        tx.move_call(&CallMove {
            call_id: &found.call_id,
            from: waiting,
            to: CallState::Rejected,
            set: CallSet::State,
        })
        .await?;
        return Ok(Err(StoreError::Expired {
            id: approval_id.to_string(),
        }));
    }
    let (status, state) = if approve {
        (ApprovalStatus::Approved, CallState::Approved)
    } else {
        (ApprovalStatus::Denied, CallState::Rejected)
    };
    tx.move_approval(&ApprovalMove {
        approval_id,
        from: ApprovalStatus::Pending,
        to: status,
        decided_at: now,
        verdict: Some(verdict),
    })
    .await?;
    tx.move_call(&CallMove {
        call_id: &found.call_id,
        from: waiting,
        to: state,
        set: CallSet::State,
    })
    .await?;
    let decided = tx
        .approval(approval_id)
        .await?
        .ok_or_else(|| approval_not_found(approval_id))?;
    Ok(Ok(decided))
}

/// See [`super::Store::approve_approval`]. The approval row is locked first, so the
/// approvals of racing approvers are counted one after the other and exactly one of
/// them completes the quorum.
pub(super) async fn approve_approval(
    tx: &mut impl Tx,
    approval_id: &ApprovalId,
    verdict: Verdict<'_>,
    input_sha256: &str,
    quorum: u32,
    now: Timestamp,
) -> Result<Kept<Approval>, StoreError> {
    let Some(found) = tx.approval_for_update(approval_id).await? else {
        return Err(approval_not_found(approval_id));
    };
    if found.status != ApprovalStatus::Pending || found.expires_at <= now {
        // Decided or expired: the decision's own answer (and the expiry it records).
        return decide_approval(tx, approval_id, true, verdict, now).await;
    }
    let votes = tx.approval_votes(approval_id).await?;
    if votes.iter().any(|by| by == verdict.by) {
        return Err(StoreError::AlreadyApprovedBy {
            id: approval_id.to_string(),
            approver: verdict.by.to_owned(),
        });
    }
    tx.insert_approval_vote(approval_id, verdict.by, input_sha256, now)
        .await?;
    if votes.len() + 1 >= usize::try_from(quorum.max(1)).unwrap_or(usize::MAX) {
        return decide_approval(tx, approval_id, true, verdict, now).await;
    }
    let partial = tx
        .approval(approval_id)
        .await?
        .ok_or_else(|| approval_not_found(approval_id))?;
    Ok(Ok(partial))
}

/// `approved` → `dispatched`, or a lapsed `dispatched` claim taken over, for
/// `claimant` until `lease_until`. False when the call is in any other state or held
/// by a live claim; [`StoreError::NotFound`] if there is no such call.
pub(super) async fn claim_for_dispatch(
    tx: &mut impl Tx,
    call_id: &CallId,
    claimant: &str,
    now: Timestamp,
    lease_until: Timestamp,
) -> Result<bool, StoreError> {
    let claimed = tx
        .move_call(&CallMove {
            call_id,
            from: CallFilter::claimable(now),
            to: CallState::Dispatched,
            set: CallSet::Claim {
                claimant,
                lease_until,
            },
        })
        .await?;
    if !claimed && !tx.call_exists(call_id).await? {
        return Err(call_not_found(call_id));
    }
    Ok(claimed)
}

/// A longer lease for a `dispatched` call, by the claimant holding it only.
pub(super) async fn renew_lease(
    tx: &mut impl Tx,
    call_id: &CallId,
    claimant: &str,
    lease_until: Timestamp,
) -> Result<bool, StoreError> {
    tx.move_call(&CallMove {
        call_id,
        from: CallFilter {
            states: States::In(&[CallState::Dispatched]),
            or_lapsed_at: None,
            held_by: Some(claimant),
        },
        to: CallState::Dispatched,
        set: CallSet::Lease(lease_until),
    })
    .await
}

/// The calls claimable at `now` (see [`CallFilter::claimable`]), oldest first.
pub(super) async fn resumable_calls(
    tx: &mut impl Tx,
    now: Timestamp,
) -> Result<Vec<StoredCall>, StoreError> {
    // Ids first, then each row: the sort never holds a call's input.
    let ids = tx.call_ids(&CallFilter::claimable(now)).await?;
    let mut out = Vec::with_capacity(ids.len());
    for id in &ids {
        // A call that vanished in between is left out.
        if let Some(call) = tx.call(id).await? {
            out.push(call);
        }
    }
    Ok(out)
}

/// At most `limit` pending approvals past their deadline → `expired`, their calls
/// `pending_approval` → `rejected`; each returned with whose call it was.
pub(super) async fn expire_approvals(
    tx: &mut impl Tx,
    now: Timestamp,
    limit: usize,
) -> Result<Vec<ExpiredApproval>, StoreError> {
    let swept = tx
        .sweep_approvals(&Sweep {
            from: ApprovalStatus::Pending,
            to: ApprovalStatus::Expired,
            due_by: now,
            decided_at: now,
            limit,
        })
        .await?;
    let mut out = Vec::with_capacity(swept.len());
    for (approval_id, call_id) in swept {
        tx.move_call(&CallMove {
            call_id: &call_id,
            from: CallFilter::states(States::In(&[CallState::PendingApproval])),
            to: CallState::Rejected,
            set: CallSet::State,
        })
        .await?;
        // The approvals table references the call: one that is missing is tampering.
        let owner = tx.call_owner(&call_id).await?.ok_or_else(|| {
            StoreError::Corrupt(format!(
                "approval {approval_id} names a missing call {call_id}"
            ))
        })?;
        out.push(ExpiredApproval {
            approval_id,
            call_id,
            principal: owner.principal,
            session_id: owner.session_id,
        });
    }
    Ok(out)
}
