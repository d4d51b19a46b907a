"""A Django 5.2 project with the django-tasks backport and its database backend
(django-tasks-db), as a Django team runs it; it does not import this project (the tasks
that record steps import the step ledger when they run)."""
