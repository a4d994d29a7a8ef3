{{/* Names and labels shared by every template of the chart. */}}

{{- define "rulebook.fullname" -}}
{{- default .Release.Name .Values.fullnameOverride | trunc 52 | trimSuffix "-" -}}
{{- end -}}

{{- define "rulebook.selectorLabels" -}}
app.kubernetes.io/name: rulebook
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "rulebook.labels" -}}
{{ include "rulebook.selectorLabels" . }}
app.kubernetes.io/part-of: rulebook
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end -}}

{{- define "rulebook.leaseName" -}}
{{- default (include "rulebook.fullname" .) .Values.leaderElection.leaseName -}}
{{- end -}}

{{/* What the RBAC was generated for (rulebook rbac --helm-values): the operator's flags
follow it, so the flags and the grants cannot disagree. Fails without generated RBAC. */}}
{{- define "rulebook.generated" -}}
{{- if not .Values.rbac.clusterRules -}}
{{- fail "rbac.clusterRules is empty: generate the RBAC from your rules with `rulebook rbac --helm-values` and pass it with -f (docs/operations.md, Install with Helm)" -}}
{{- end -}}
{{- $g := .Values.rbac.generatedFor | default dict -}}
{{- if and $g.webhooks (not $g.webhookConfiguration) -}}
{{- fail "rbac.generatedFor.webhookConfiguration is missing: regenerate with rulebook rbac --helm-values" -}}
{{- end -}}
{{- if and .Values.sharding.enabled $g.leaderElect -}}
{{- fail "the RBAC was generated with --leader-elect (a Lease ClusterRole); the chart grants Leases in its namespace: regenerate without it" -}}
{{- end -}}
{{- toYaml $g -}}
{{- end -}}
