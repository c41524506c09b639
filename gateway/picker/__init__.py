"""kvgate as an Envoy ext_proc endpoint picker (the Gateway API Inference Extension's EPP): Envoy
keeps the connections and streams the bytes; the picker reads each request's headers and body,
admits and routes it with the gateway's own state, and names the replica for Envoy to use."""
