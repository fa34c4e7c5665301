//! The statements derived from the column lists.

use super::sql::Shared;

/// The update statements, derived from the column lists, rewrite exactly the columns a
/// transition may change.
#[test]
fn update_statements_rewrite_what_transitions_change() {
    let sql = Shared::new('$');
    assert_eq!(
        sql.update_todo,
        "UPDATE todos SET state = $2, owner = $3, attempt = $4, attempts_total = $5, \
         attempts_pruned = $6, lease_expires_at = $7, claimed_at = $8, next_retry_at = $9, \
         result = $10, updated_at = $11, dead_letter_reason = $12, deadline_at = $13, \
         input_requests = $14, answer_due_at = $15, budget_cost_micros = $16, \
         budget_tokens = $17, spent_cost_micros = $18, spent_input_tokens = $19, \
         spent_output_tokens = $20, run_at = $21, \
         lease_due_at = CASE WHEN todos.state = 'claimed' AND $2::text = 'claimed' \
         AND todos.attempts_total = $5::integer \
         THEN least(todos.lease_due_at, $7::bigint) ELSE $7::bigint END, \
         finished_at = CASE WHEN $2::text IN ('done', 'canceled', 'failed') \
         THEN $11::bigint END \
         WHERE id = $1"
    );
    assert_eq!(
        Shared::new('?').update_todo,
        "UPDATE todos SET state = ?2, owner = ?3, attempt = ?4, attempts_total = ?5, \
         attempts_pruned = ?6, lease_expires_at = ?7, claimed_at = ?8, next_retry_at = ?9, \
         result = ?10, updated_at = ?11, dead_letter_reason = ?12, deadline_at = ?13, \
         input_requests = ?14, answer_due_at = ?15, budget_cost_micros = ?16, \
         budget_tokens = ?17, spent_cost_micros = ?18, spent_input_tokens = ?19, \
         spent_output_tokens = ?20, run_at = ?21 \
         WHERE id = ?1"
    );
    assert_eq!(
        sql.update_open_attempt,
        "UPDATE todo_attempts SET last_heartbeat_at = $3, lease_expires_at = $4, \
         ended_at = $5, outcome = $6, disposition = $7, summary = $8, \
         summary_truncated = $9, artifact = $10, closed_by = $11, failure_signature = $12, \
         dead_letter_reason = $13, question = $14, usage_cost_micros = $15, \
         usage_input_tokens = $16, usage_output_tokens = $17 \
         WHERE todo_id = $1 AND seq = $2 AND ended_at IS NULL"
    );
    assert_eq!(
        sql.update_amend,
        "UPDATE todo_attempts SET late_reports = $3, late_reports_total = $4, answer = $5, \
         answered_at = $6, answered_by = $7, answer_key = $8 \
         WHERE todo_id = $1 AND seq = $2 AND ended_at IS NOT NULL"
    );
}
