{{- define "kubetrt.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kubetrt.operatorName" -}}
{{- printf "%s-operator" (include "kubetrt.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kubetrt.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "kubetrt.labels" -}}
{{ include "kubetrt.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kubetrt
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "kubetrt.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kubetrt.operatorName" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kubetrt.image" -}}
{{- printf "%s:%s" .repository .tag -}}
{{- end -}}
