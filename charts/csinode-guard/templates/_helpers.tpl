{{/*
The chart mirrors deploy/: one template per file of deploy/base (and of the overlays the values select), with
the same objects. Names are fixed (the guard injects the caBundle of the webhook configurations named
csinode-guard, and its state is keyed to them); only the namespace follows the release.
*/}}

{{/* The release namespace: where the Deployment, its Service, Secrets and Lease live. */}}
{{- define "csinode-guard.namespace" -}}
{{- .Release.Namespace -}}
{{- end }}

{{/* Labels of every object: deploy/'s name label plus the two Helm adds by convention (never in selectors). */}}
{{- define "csinode-guard.labels" -}}
app.kubernetes.io/name: csinode-guard
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The Service's DNS name, the one the serving certificate carries. */}}
{{- define "csinode-guard.serviceDNS" -}}
csinode-guard.{{ include "csinode-guard.namespace" . }}.svc
{{- end }}

{{/*
The GuardPolicy document the chart ships: .Values.policy, or the bundled default (files/policy.yaml, a copy of
policies/default.yaml); spec.reconcile replaced by .Values.reconcile when set; the guard's own ServiceAccount
among the writers follows the release namespace.
*/}}
{{- define "csinode-guard.policy" -}}
{{- $policy := .Values.policy | default (.Files.Get "files/policy.yaml") -}}
{{- if .Values.reconcile -}}
{{- if not (regexMatch "(?m)^  reconcile: " $policy) -}}
{{- fail "reconcile is set but the policy has no top-level `  reconcile:` line under spec to replace" -}}
{{- end -}}
{{- $policy = regexReplaceAll "(?m)^  reconcile: [A-Za-z]+" $policy (printf "  reconcile: %s" .Values.reconcile) -}}
{{- end -}}
{{- $policy | replace "\"csinode-guard/csinode-guard\"" (printf "%q" (printf "%s/csinode-guard" (include "csinode-guard.namespace" .))) -}}
{{- end }}
