{{/* Names: everything of a release is <fullname>-<part>; the cluster-scoped user roles have
fixed names (stasis-checkpoint-viewer, ...) as users bind them by name. */}}
{{- define "stasis.fullname" -}}
{{- if contains "stasis" .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "stasis-%s" .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "stasis.labels" -}}
app.kubernetes.io/name: stasis
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: stasis
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* selector labels of a component: (dict "ctx" $ "component" "agent") */}}
{{- define "stasis.selectorLabels" -}}
app.kubernetes.io/name: stasis
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "stasis.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{- define "stasis.agentServiceAccount" -}}{{ include "stasis.fullname" . }}-agent{{- end -}}
{{- define "stasis.controllerServiceAccount" -}}{{ include "stasis.fullname" . }}-controller{{- end -}}
{{- define "stasis.controllerService" -}}{{ include "stasis.fullname" . }}-controller{{- end -}}
{{- define "stasis.webhookSecret" -}}{{ .Values.webhook.tls.existingSecret | default (printf "%s-webhook-tls" (include "stasis.fullname" .)) }}{{- end -}}

{{- define "stasis.clusterKeySecret" -}}
{{- .Values.keys.clusterKeySecret | default (printf "%s-cluster-key" (include "stasis.fullname" .)) -}}
{{- end -}}

{{- define "stasis.webhookEnabled" -}}
{{- if and .Values.webhook.enabled (not .Values.controller.standIn) -}}true{{- end -}}
{{- end -}}

{{/* the node's path of a node file, as a hostPath: nodeRoot + path */}}
{{- define "stasis.nodePath" -}}
{{- $root := .ctx.Values.nodeRoot | default "/" | trimSuffix "/" -}}
{{- printf "%s%s" $root .path -}}
{{- end -}}

{{/* environment shared by the agent and the controller: store and keys */}}
{{- define "stasis.storeEnv" -}}
- name: STASIS_NAMESPACE
  valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
- name: POD_NAMESPACE
  valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
- name: POD_NAME
  valueFrom: {fieldRef: {fieldPath: metadata.name}}
{{- with .Values.store.url }}
- name: STASIS_STORE
  value: {{ . | quote }}
- name: STASIS_STORE_URL
  value: {{ . | quote }}
{{- end }}
{{- range $k, $v := .Values.store.s3.env }}
- name: {{ $k }}
  value: {{ $v | quote }}
{{- end }}
{{- if .Values.store.s3.existingSecret }}
{{- range list "AWS_ACCESS_KEY_ID" "AWS_SECRET_ACCESS_KEY" }}
- name: {{ . }}
  valueFrom: {secretKeyRef: {name: {{ $.Values.store.s3.existingSecret | quote }}, key: {{ . }}}}
{{- end }}
{{- range list "AWS_REGION" "AWS_ENDPOINT_URL" "AWS_SESSION_TOKEN" }}
- name: {{ . }}
  valueFrom: {secretKeyRef: {name: {{ $.Values.store.s3.existingSecret | quote }}, key: {{ . }}, optional: true}}
{{- end }}
{{- end }}
{{- end -}}

{{- define "stasis.keyVolume" -}}
- name: cluster-key
  secret:
    secretName: {{ include "stasis.clusterKeySecret" . }}
    # the whole Secret: cluster.key and, after a rotation, retired.keys (docs/security.md)
    defaultMode: 0400
{{- end -}}
