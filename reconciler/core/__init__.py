"""The pure core: vocabulary, evidence, the decision table, policy rules, the pass, and the
ports (protocols) that storage and sources implement. No SQL, no SQLAlchemy, no clock."""
