-- Backbone and head artifacts: a head is served on the backbone it pins (artifact id and
-- manifest digest, from its manifest). A head is published only while that backbone is
-- registered, ready, with that digest and beside it in the store; a backbone is never a
-- target itself, and is not rejected while a targeted head runs on it.

ALTER TABLE model_artifact ADD COLUMN kind TEXT NOT NULL DEFAULT 'model'
    CHECK (kind IN ('model', 'backbone', 'head'));
ALTER TABLE model_artifact ADD COLUMN backbone_artifact_id TEXT;
ALTER TABLE model_artifact ADD COLUMN backbone_manifest_sha256 TEXT;
