"""This project's own tables: engines and the database clock, the schema check, and the SQL
of every operation on them, split by concern. The native job source lives here."""
