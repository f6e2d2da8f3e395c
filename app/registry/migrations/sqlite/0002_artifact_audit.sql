-- Registrations, approvals and rejections of artifacts in the audit log, beside the target
-- publishes of target_audit: who decided what about an artifact, when, and why.

CREATE TABLE artifact_audit (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    model        TEXT NOT NULL,
    artifact_id  TEXT NOT NULL,
    action       TEXT NOT NULL CHECK (action IN ('register', 'approve', 'reject')),
    old_state    TEXT,
    new_state    TEXT NOT NULL CHECK (new_state IN ('pending', 'ready', 'rejected')),
    actor        TEXT NOT NULL,
    reason       TEXT,
    at           TEXT NOT NULL,
    FOREIGN KEY (model, artifact_id) REFERENCES model_artifact (model, artifact_id)
);
CREATE INDEX artifact_audit_by_model ON artifact_audit (model, id);
