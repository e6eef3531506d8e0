"""The examples' pytest set-up: trace-replay's pytest plugin, loaded by name so that the examples
run from a source tree too. A project that installs trace-replay gets the plugin through its
``pytest11`` entry point and needs no such line."""

pytest_plugins = ["trace_replay_app.pytest_plugin"]
