-- Initial registry schema, SQLite dialect.
-- Timestamps are UTC ISO-8601 text of one fixed width ("YYYY-MM-DDTHH:MM:SS.ffffffZ"), so text
-- order is time order; a TIMESTAMPTZ column would get numeric affinity and mangle them.
-- JSON documents are text, checked with json_valid().

CREATE TABLE model_artifact (
    model            TEXT NOT NULL,
    artifact_id      TEXT NOT NULL,
    manifest_uri     TEXT NOT NULL,
    manifest_sha256  TEXT NOT NULL CHECK (length(manifest_sha256) = 64),
    state            TEXT NOT NULL CHECK (state IN ('pending', 'ready', 'rejected')),
    feature_schema   TEXT NOT NULL,
    runtime          TEXT NOT NULL,
    metadata         TEXT NOT NULL DEFAULT '{}' CHECK (json_valid(metadata)),
    state_actor      TEXT,
    state_reason     TEXT,
    created_at       TEXT NOT NULL,
    updated_at       TEXT NOT NULL,
    PRIMARY KEY (model, artifact_id)
);

CREATE TABLE deployment_target (
    model        TEXT NOT NULL,
    environment  TEXT NOT NULL,
    cohort       TEXT NOT NULL CHECK (cohort IN ('stable', 'canary')),
    revision     INTEGER NOT NULL CHECK (revision > 0),
    artifact_id  TEXT NOT NULL,
    updated_at   TEXT NOT NULL,
    PRIMARY KEY (model, environment, cohort),
    FOREIGN KEY (model, artifact_id) REFERENCES model_artifact (model, artifact_id)
);

CREATE TABLE target_audit (
    id               INTEGER PRIMARY KEY AUTOINCREMENT,
    model            TEXT NOT NULL,
    environment      TEXT NOT NULL,
    cohort           TEXT NOT NULL CHECK (cohort IN ('stable', 'canary')),
    old_artifact_id  TEXT,
    new_artifact_id  TEXT NOT NULL,
    old_revision     INTEGER NOT NULL CHECK (old_revision >= 0),
    new_revision     INTEGER NOT NULL CHECK (new_revision > old_revision),
    actor            TEXT NOT NULL,
    reason           TEXT NOT NULL,
    approval         TEXT,
    at               TEXT NOT NULL,
    FOREIGN KEY (model, new_artifact_id) REFERENCES model_artifact (model, artifact_id)
);
CREATE INDEX target_audit_by_cohort ON target_audit (model, environment, cohort, id);

CREATE TABLE rollout (
    id                     TEXT PRIMARY KEY,
    model                  TEXT NOT NULL,
    environment            TEXT NOT NULL,
    candidate_artifact_id  TEXT NOT NULL,
    baseline_artifact_id   TEXT,
    plan                   TEXT NOT NULL CHECK (json_valid(plan)),
    phase                  TEXT NOT NULL,
    step                   INTEGER NOT NULL DEFAULT 0 CHECK (step >= 0),
    weights                TEXT NOT NULL DEFAULT '{}' CHECK (json_valid(weights)),
    verdicts               TEXT NOT NULL DEFAULT '[]' CHECK (json_valid(verdicts)),
    state                  TEXT NOT NULL DEFAULT '{}' CHECK (json_valid(state)),
    reason                 TEXT,
    version                INTEGER NOT NULL CHECK (version > 0),
    created_at             TEXT NOT NULL,
    updated_at             TEXT NOT NULL,
    finished_at            TEXT,
    FOREIGN KEY (model, candidate_artifact_id) REFERENCES model_artifact (model, artifact_id),
    FOREIGN KEY (model, baseline_artifact_id) REFERENCES model_artifact (model, artifact_id)
);
-- At most one unfinished rollout per model and environment.
CREATE UNIQUE INDEX rollout_one_active ON rollout (model, environment) WHERE finished_at IS NULL;
CREATE INDEX rollout_by_created ON rollout (model, environment, created_at);

CREATE TABLE replica_report (
    replica_id           TEXT PRIMARY KEY,
    model                TEXT NOT NULL,
    environment          TEXT NOT NULL,
    cohort               TEXT NOT NULL CHECK (cohort IN ('stable', 'canary')),
    state                TEXT NOT NULL,
    desired_revision     INTEGER,
    desired_artifact_id  TEXT,
    actual_revision      INTEGER,
    actual_artifact_id   TEXT,
    last_error           TEXT,
    heartbeat_at         TEXT NOT NULL,
    capacity             TEXT NOT NULL DEFAULT '{}' CHECK (json_valid(capacity)),
    timings              TEXT NOT NULL DEFAULT '{}' CHECK (json_valid(timings))
);
CREATE INDEX replica_report_by_heartbeat ON replica_report (model, environment, heartbeat_at);
